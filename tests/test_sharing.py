"""How much of the sm100 kernel's code the sm90 kernel also runs (`fa4lab.kernels.sharing`):
exact counts on a tiny package written here, the rule on the real kernels, and the README's
table. Pure `ast` on the source text: no CuTe DSL import, no compile."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fa4lab.kernels import sharing
from fa4lab.kernels.sharing import Row

README = Path(__file__).resolve().parents[1] / "README.md"

# A two-kernel package. The comments on the right count each unit's lines of code by hand.
SM100 = '''\
"""Kernel A: the module docstring is module-level, not counted."""

from fa4lab.kernels.device import shared
from fa4lab.kernels.device.shared import Helper
from fa4lab.kernels.device.shared import only_sm100 as only

SCALE = 2  # module-level code: not counted


def _tile(x):                                 # 1
    return x * SCALE                          # 2  -> _tile: 2


def attention_a(x):                           # host entry point: nothing reaches it
    return KernelA()(x)


class KernelA:                                # 1  -> KernelA (the class's own line): 1
    """The kernel class: counted whole."""

    def __call__(self, x):                    # 1
        h = Helper()                          # 2
        return self.kernel(_tile(x)) * h.k    # 3  -> __call__: 3

    @cute.kernel                              # 1
    def kernel(self, x):                      # 2
        # a comment line, not counted

        y = shared.both(x)                    # 3
        return only(y) + shared.inner(y)      # 4  -> kernel: 4
'''

SM90 = '''\
import fa4lab.kernels.device.shared as sh
from fa4lab.kernels.device.shared import Helper, deep


def port_table():
    return sh.unused(0)


class KernelB:
    @cute.kernel
    def kernel(self, x: Helper, deep=1):      # an annotation and a parameter named deep
        return sh.both(x) + deep              # reach neither Helper nor shared.deep
'''

SHARED = '''\
"""Device code both kernels import."""

LIMIT = 4


def both(x):                                  # 1
    """Called by both kernels.

    Its docstring does not count.
    """
    # nor does this comment
    return inner(x)                           # 2  -> both: 2, shared


def inner(x):                                 # 1
    s = """a string
    spanning two lines"""                     # 2, 3: a string's lines are code
    return x + len(s)                         # 4  -> inner: 4, shared through both


def only_sm100(x):                            # 1
    return deep(x)                            # 2  -> only_sm100: 2


def deep(x):                                  # 1
    return x - LIMIT                          # 2  -> deep: 2, sm100 only through only_sm100


def unused(x):
    return x


class Helper:                                 # 1
    """Taken whole when referenced."""

    factor = 3                                # 2  -> Helper (own lines): 2

    def __init__(self):                       # 1
        self.k = self.factor                  # 2  -> Helper.__init__: 2

    def never_called(self):                   # 1
        return self.k                         # 2  -> Helper.never_called: 2
'''


@pytest.fixture
def toy(tmp_path):
    """fa4lab/kernels/{fwd_sm100,fwd_sm90}.py and kernels/device/shared.py, no __init__.py."""
    kernels = tmp_path / "fa4lab" / "kernels"
    (kernels / "device").mkdir(parents=True)
    (kernels / "fwd_sm100.py").write_text(SM100)
    (kernels / "fwd_sm90.py").write_text(SM90)
    (kernels / "device" / "shared.py").write_text(SHARED)
    return tmp_path / "fa4lab"


def test_counts_on_a_tiny_package(toy):
    rows = sharing.share(toy)
    kernel = 2 + 1 + 3 + 4                    # _tile, KernelA, __call__, kernel
    shared_sm100 = 2 + 4 + 2 + 2 + (2 + 2 + 2)   # both, inner, only_sm100, deep, Helper
    shared_both = 2 + 4                       # both, and inner through it
    assert rows == [
        Row("kernels/fwd_sm100.py", kernel, 0,
            ("_tile", "KernelA", "KernelA.__call__", "KernelA.kernel")),
        Row("kernels/device/shared.py", shared_sm100, shared_both,
            ("only_sm100", "deep", "Helper", "Helper.__init__", "Helper.never_called")),
    ]
    total = sharing.totals(rows)
    assert (total.lines_sm100, total.lines_shared) == (kernel + shared_sm100, shared_both)
    assert total.functions_sm100_only[0] == "kernels/fwd_sm100.py:_tile"
    assert sharing.markdown(rows).splitlines()[2:] == [
        "| `kernels/fwd_sm100.py` | 10 | 0 | 0% |",
        "| `kernels/device/shared.py` | 16 | 6 | 38% |",
        "| **total** | **26** | **6** | **23%** |",
    ]


def test_a_kernel_file_without_a_kernel_class_is_an_error(toy):
    (toy / "kernels" / "fwd_sm90.py").write_text("def kernel():\n    pass\n")
    with pytest.raises(ValueError, match="no class with a @cute.kernel method"):
        sharing.share(toy)


@pytest.fixture(scope="module")
def rows():
    return sharing.share()


def test_the_real_kernels(rows):
    by_module = {r.module: r for r in rows}
    assert rows[0].module == "kernels/fwd_sm100.py"
    kernel = by_module["kernels/fwd_sm100.py"]
    assert kernel.lines_sm100 > 0 and kernel.lines_shared == 0
    assert "FlashForwardSm100.kernel" in kernel.functions_sm100_only
    assert not any(f.startswith("attention_sm100") for f in kernel.functions_sm100_only)
    exp2 = by_module["kernels/device/exp2.py"]
    assert exp2.lines_sm100 > 0 and exp2.lines_shared == 0
    assert "exp2_poly3_x2" in exp2.functions_sm100_only
    assert "kernels/fwd_sm90.py" not in by_module     # only what the sm100 kernel reaches
    for r in rows:
        assert 0 <= r.lines_shared <= r.lines_sm100, r
        assert r.lines_sm100 > 0, r
    assert sharing.totals(rows).lines_shared > 0


def test_cli_json_matches_share(rows, capsys):
    sharing.main(["--json"])
    out = json.loads(capsys.readouterr().out)
    assert [r["module"] for r in out["rows"]] == [r.module for r in rows]
    assert out["total"]["lines_sm100"] == sharing.totals(rows).lines_sm100
    sharing.main([])
    assert capsys.readouterr().out == sharing.markdown(rows)


def test_imports_no_dsl():
    code = ("import sys; from fa4lab.kernels import sharing; sharing.share(); "
            "assert not [m for m in sys.modules if m.split('.')[0] in ('cutlass', 'torch')]")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_readme_holds_the_current_table(rows):
    text = README.read_text()
    found = re.search(r"<!-- sharing:begin -->\n(.*?)<!-- sharing:end -->", text, re.S)
    assert found, "README.md needs the sharing table between its sharing:begin/end markers"
    assert found.group(1).strip() == sharing.markdown(rows).strip(), textwrap.dedent("""\
        README.md's sharing table is stale: paste the output of
        `python -m fa4lab.kernels.sharing` between its sharing:begin/end markers""")
