"""The control flow of a PTX listing: its basic blocks, its loops and an order of its lines that
follows the control flow. The audit reads the barrier markers of each code path in that order
and checks which of them sit inside a loop (`fa4lab.kernels.audit`).

    from fa4lab.kernels import ptx_flow
    ptx_flow.ptx_loops(ptx)        # line -> the innermost loop holding it, or None
    ptx_flow.program_order(ptx)    # the lines in control-flow order

No DSL, no plan: text in, line numbers out.
"""

from __future__ import annotations

import heapq
import re


def ptx_loops(ptx: str) -> dict[int, str | None]:
    """Line -> the loop (a strongly connected set of basic blocks, named by its first label)
    holding that line, or None. Inline assembly is opaque (a wait's retry loop is not a loop
    here)."""
    lines = ptx.splitlines()
    blocks, order = _basic_blocks(lines)
    inner = _innermost_loops(order, {b: blocks[b][2] for b in order})
    out = {}
    for name in order:
        start, end, _ = blocks[name]
        for i in range(start, end):
            out[i] = inner.get(name)
    return out


def _innermost_loops(order, succ) -> dict:
    """Block -> the innermost loop holding it (named by its first block), for nested loops (a
    persistent kernel's tile loop around its block loops): a loop's strongly connected blocks
    without the back edges to its header hold its inner loops."""
    preds = {b: set() for b in order}
    for b in order:
        for s in succ[b]:
            if s in preds:
                preds[s].add(b)
    out = {}

    def walk(nodes, edges):
        comp = strongly_connected(nodes, edges)
        members: dict[str, list[str]] = {}
        for b in nodes:
            members.setdefault(comp[b][0], []).append(b)
        for head, bs in members.items():
            if not comp[head][1]:
                continue
            inside = set(bs)
            entries = [b for b in bs if preds[b] - inside]
            header = entries[0] if entries else bs[0]
            for b in bs:
                out[b] = header
            walk(bs, {b: [s for s in edges[b] if s in inside and s != header] for b in bs})

    walk(list(order), {b: list(succ[b]) for b in order})
    return out


def program_order(ptx: str) -> list[int]:
    """Line numbers in an order that respects control flow: the loops (strongly connected
    blocks) contracted and topologically sorted (ties by position), each loop's blocks ordered
    the same way once the back edges to its header are cut, so nested loops (a persistent
    kernel's tile loop around its block loops) come out in control-flow order too. PTX lays
    blocks out in any order (a loop may follow the code after it)."""
    lines = ptx.splitlines()
    blocks, order = _basic_blocks(lines)
    preds = {b: set() for b in order}
    for b in order:
        for x in blocks[b][2]:
            if x in preds:
                preds[x].add(b)
    out = []
    for b in _block_order(order, {b: [x for x in blocks[b][2] if x in preds] for b in order},
                          preds, {b: blocks[b][0] for b in order}):
        out += range(blocks[b][0], blocks[b][1])
    return out


def _block_order(nodes, edges, preds, pos) -> list[str]:
    """`nodes` in control-flow order: SCCs topologically sorted, ties by text position, each
    loop's blocks in turn ordered without the back edges to its header."""
    comp = strongly_connected(nodes, edges)
    members: dict[str, list[str]] = {}
    for b in nodes:
        members.setdefault(comp[b][0], []).append(b)
    dag = {c: set() for c in members}
    indeg = dict.fromkeys(members, 0)
    for b in nodes:
        for x in edges[b]:
            if comp[x][0] != comp[b][0] and comp[x][0] not in dag[comp[b][0]]:
                dag[comp[b][0]].add(comp[x][0])
                indeg[comp[x][0]] += 1
    first = {c: min(pos[b] for b in bs) for c, bs in members.items()}
    ready = [(first[c], c) for c, d in indeg.items() if d == 0]
    heapq.heapify(ready)
    out = []
    while ready:
        _, c = heapq.heappop(ready)
        bs = members[c]
        if len(bs) > 1:
            inside = set(bs)
            entries = sorted((b for b in bs if preds[b] - inside), key=pos.get)
            header = entries[0] if entries else min(bs, key=pos.get)
            out += _block_order(bs, {b: [x for x in edges[b] if x in inside and x != header]
                                     for b in bs}, preds, pos)
        else:
            out += bs
        for x in dag[c]:
            indeg[x] -= 1
            if indeg[x] == 0:
                heapq.heappush(ready, (first[x], x))
    return out


def _basic_blocks(lines):
    """{label: (start line, end line, successor labels)} and the labels in text order. A
    conditional branch ends its block too: the code after it (a loop's exit, falling through
    its latch) is a block of its own, named after the branch's line."""
    blocks, order = {}, []
    cur, start, succ, falls, in_asm = "entry", 0, [], True, False

    def close(end, fall_to):
        blocks[cur] = (start, end, succ + ([fall_to] if fall_to else []))
        order.append(cur)

    for i, ln in enumerate(lines):
        s = ln.strip()
        if s == "// begin inline asm":
            in_asm = True
            continue
        if s == "// end inline asm":
            in_asm = False
            continue
        if in_asm:
            continue
        m = re.match(r"(\$L__\w+):", s)
        if m:
            close(i, m.group(1) if falls else None)
            cur, start, succ, falls = m.group(1), i, [], True
            continue
        m = re.match(r"(@!?%p\d+\s+)?bra(?:\.uni)?\s+(\$L__\w+);", s)
        if m:
            succ.append(m.group(2))
            if not m.group(1):
                falls = False
            else:
                after = f"line {i + 1}"
                close(i + 1, after)
                cur, start, succ, falls = after, i + 1, [], True
        elif s.startswith(("ret;", "exit;")):
            falls = False
    close(len(lines), None)
    return blocks, order


def strongly_connected(nodes, edges):
    """Tarjan, iteratively: node -> (component head, is a loop), over `nodes` and `edges`
    (node -> its successors; a successor that is not a key of `edges` is ignored). Read by the
    PTX's loops here and by the package's import-circle test."""
    index, low, stack, on, res, counter = {}, {}, [], set(), {}, [0]
    for root in nodes:
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            v, i = work.pop()
            if i == 0:
                index[v] = low[v] = counter[0]
                counter[0] += 1
                stack.append(v)
                on.add(v)
            succ = [w for w in edges.get(v, []) if w in edges]
            if i < len(succ):
                work.append((v, i + 1))
                w = succ[i]
                if w not in index:
                    work.append((w, 0))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                loop = len(comp) > 1 or v in edges.get(v, [])
                for w in comp:
                    res[w] = (v, loop)
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[v])
    return res
