# The commands the README shows. `make lab` and `make test` install what they need themselves.
PYTHON ?= python3
VENV ?= .venv
# A CPU machine gets torch's CPU build; a GPU host overrides it (TORCH_SPEC= keeps what is there).
TORCH_SPEC ?= torch==2.13.0
# Which python runs the GPU tests: the venv's if there is one, else the host's (a GPU box
# usually has its own torch with CUDA).
PY ?= $(shell test -x $(VENV)/bin/python && echo $(VENV)/bin/python || echo $(PYTHON))
PORT ?= 8888
NOTEBOOK ?= notebooks/00_start_here.ipynb
RELEASE ?= course/release
CHROMIUM ?= /usr/bin/chromium
LAB_ARGS ?=

# What `make test-fast` leaves out: kernel compiles, the browser, slow tests and GPU tests.
FAST_MARKERS ?= not compile and not browser and not slow and not gpu and not sm90 and not sm100
# The CPU tiers' pytest processes, side by side (tests/shards.py: whole test modules each, kernel
# compiles spread evenly): one per core of CI's 2-core machine. CPU_JOBS=1 runs one process.
CPU_JOBS ?= 2

.PHONY: install lab student test durations test-fast test-gpu fuzz-gpu sanitize-gpu browser-deps lint clean course

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	@if [ -n "$(TORCH_SPEC)" ]; then $(VENV)/bin/python -m pip install -q "$(TORCH_SPEC)"; fi
	$(VENV)/bin/python -m pip install -q -e ".[test]"
	touch $@

# Headless when NO_BROWSER=1 or there is no display; --allow-root because CI and containers run as root.
define open_lab
	@if [ -n "$$NO_BROWSER" ] || [ -z "$$DISPLAY$$WAYLAND_DISPLAY" ]; then nb="--no-browser"; else nb=""; fi; \
	$(VENV)/bin/jupyter lab $$nb --allow-root --ip 127.0.0.1 --port $(PORT) $(LAB_ARGS) $(1)
endef

# The instructor's notebooks, solutions included.
lab: install
	$(call open_lab,$(NOTEBOOK))

# A student's: the release (solutions replaced by stubs, see `make course`), built first when
# missing or older than the notebooks.
student: $(RELEASE)/.built
	$(call open_lab,$(RELEASE)/00_start_here.ipynb)

$(RELEASE)/.built: $(wildcard notebooks/*.ipynb) | install
	$(VENV)/bin/python -m fa4lab.exercises release notebooks $(RELEASE)
	touch $@

# The browser test drives Debian's chromium; install it when missing (needs root, as in CI).
browser-deps:
	@if [ ! -x $(CHROMIUM) ]; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
	      || { echo "could not install chromium with apt-get"; exit 1; }; \
	  else echo "the browser test needs $(CHROMIUM): run 'sudo apt-get install chromium'"; fi; \
	fi

# $(call timed,TIER,COMMAND): echo and run COMMAND, then print "tier TIER: <seconds> s", pass or
# fail, and keep its exit status: CI's log says where its time went, tier by tier.
define timed
	@echo '$(2)'; start=$$(date +%s); rc=0; $(2) || rc=$$?; \
	echo "tier $(1): $$(( $$(date +%s) - start )) s"; exit $$rc
endef

# What CI runs: lint first (fails in seconds), then every test (compile matrix and browser
# included, CPU_JOBS processes) and every notebook: the ones with graded exercises run whole in
# tests/test_course.py (graded with their solutions put back: full marks, no cell error), the
# others under nbmake (`python -m fa4lab.exercises ungraded`); each run ends with its 20 slowest
# tests (or notebooks; per process) and the tier's time. The kernel compile grids run a pairwise sample
# (tests/matrix.py); FA4LAB_FULL_MATRIX=1 compiles every combination.
test: lint browser-deps
	$(call timed,tests,CI=$${CI:-} $(VENV)/bin/python tests/shards.py --jobs $(CPU_JOBS) --out test-output/tests -- -q tests/ --durations=20)
	$(call timed,notebooks,$(VENV)/bin/python -m pytest -q --nbmake --nbmake-timeout=600 $$($(VENV)/bin/python -m fa4lab.exercises ungraded notebooks) --durations=20)

# Measure the `tests` tier's times again and keep them as the shares' weights (tests/durations.json:
# every test of at least 0.2 s; commit it when the suite's shape changed).
durations: install
	$(VENV)/bin/python tests/shards.py --jobs $(CPU_JOBS) --out test-output/durations --save-weights tests/durations.json -- -q tests/

# The edit loop: pure Python (plans, references, the simulator, figures, widgets) in a minute or
# two, as CPU_JOBS processes; no compiles, browser or notebooks (nor the nbmake plugin: see Note
# [rfc3987_syntax] in tests/conftest.py). A test that compiles a kernel without the `compile`
# marker fails here (FA4LAB_FORBID_COMPILE, tests/conftest.py) instead of slowing it down.
test-fast: install
	$(call timed,fast,FA4LAB_FORBID_COMPILE=1 $(VENV)/bin/python tests/shards.py --jobs $(CPU_JOBS) --out test-output/fast -- -q -p no:nbmake -m "$(FAST_MARKERS)" tests/ --durations=10)

# On a CUDA machine: the GPU-marked tests and the notebooks at realistic sizes.
# Fails (not passes vacuously) when no GPU is visible. The tests run as GPU_JOBS processes side
# by side (tests/shards.py: whole test modules per process, their compiles overlapping, kernels
# shared through the disk cache); GPU_JOBS=1 runs them in one process.
GPU_JOBS ?= 4
test-gpu:
	@$(PY) -c "import sys, torch; ok = torch.cuda.is_available(); \
	print('GPU:', torch.cuda.get_device_name(0) if ok else 'none'); \
	sys.exit(0 if ok else 'make test-gpu needs a CUDA GPU and none is visible; use make test on a CPU machine')"
	FA4LAB_SIZE=full FA4LAB_REQUIRE_GPU=1 $(PY) tests/shards.py --jobs $(GPU_JOBS) -- \
	  -q -m "gpu or sm90 or sm100" tests/
	FA4LAB_SIZE=full $(PY) -m pytest -q --nbmake --nbmake-timeout=1200 notebooks/

# On a CUDA machine: random configurations crossed over every option, against float64
# (fa4lab.fuzz: every entry point, head-dim pair, dtype, mask, mod, split, page size and layout).
# Fails when no GPU is visible. Each failure is printed with its replay command and saved
# under fuzz-failures/; a CUDA fault stops the run at the case that caused it. The first run of
# a seed spends most of its time compiling (the kernels then sit in the disk cache).
FUZZ_SECONDS ?= 200
FUZZ_SEED ?= 0
fuzz-gpu:
	@$(PY) -c "import sys, torch; ok = torch.cuda.is_available(); \
	print('GPU:', torch.cuda.get_device_name(0) if ok else 'none'); \
	sys.exit(0 if ok else 'make fuzz-gpu needs a CUDA GPU and none is visible; python -m fa4lab.fuzz --device cpu is a CPU smoke run')"
	$(PY) -m fa4lab.fuzz --seconds $(FUZZ_SECONDS) --seed $(FUZZ_SEED) --out fuzz-failures

# On a Hopper GPU with compute-sanitizer: the sm90 kernel's barriers under synccheck and its
# shared memory under racecheck (run it after touching the kernel's synchronization).
sanitize-gpu:
	for tool in synccheck racecheck; do \
	  compute-sanitizer --tool $$tool --error-exitcode 1 $(PY) tests/sanitize_sm90.py || exit 1; \
	done

# The student release of the notebooks: solutions replaced by stubs, outputs cleared, and
# points.json (see notebooks/README.md). Grade a notebook with
# `python -m fa4lab.exercises grade course/release/01_online_softmax.ipynb`.
course: install
	$(VENV)/bin/python -m fa4lab.exercises release notebooks $(RELEASE)

lint: install
	$(VENV)/bin/ruff check fa4lab tests

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
