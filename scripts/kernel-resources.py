#!/usr/bin/env python3
"""Compares the kernels of two builds of a .cu file, kernel by kernel.

Build each side with the resource report, e.g.

    nvcc -cubin -arch=sm_90 -std=c++17 --expt-relaxed-constexpr -O3 -Xptxas -v \
        -o before.cubin kernels/unified_attention.cu 2> before.txt

then run

    scripts/kernel-resources.py before.txt after.txt before.cubin after.cubin

It prints, per kernel, registers, stack frame and spill bytes (before/after)
from the ptxas reports, the instruction count (size of the kernel's .text
section in the cubin, 16 bytes per instruction on sm_90) and whether the
code bytes are identical; the last line lists the kernels whose registers,
spills or stack grew.
"""
import re, struct, sys

def report(path):
    out, cur = {}, None
    for line in open(path):
        m = re.search(r"Compiling entry function '(\w+)'", line)
        if m:
            cur = m.group(1); out[cur] = {}; continue
        if cur is None: continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m: out[cur].update(stack=int(m[1]), spill_st=int(m[2]), spill_ld=int(m[3]))
        m = re.search(r"Used (\d+) registers", line)
        if m: out[cur]['regs'] = int(m[1])
        m = re.search(r"used (\d+) barriers", line)
        if m: out[cur]['bars'] = int(m[1])
        m = re.search(r"(\d+) bytes smem", line)
        if m: out[cur]['smem'] = int(m[1])
        m = re.search(r"(\d+) bytes cmem\[0\]", line)
        if m: out[cur]['cmem0'] = int(m[1])
    return out

def texts(path):
    d = open(path, 'rb').read()
    assert d[:4] == b'\x7fELF' and d[4] == 2
    shoff, = struct.unpack_from('<Q', d, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from('<HHH', d, 0x3a)
    secs = []
    for i in range(shnum):
        name, typ, flags, addr, off, size = struct.unpack_from('<IIQQQQ', d, shoff + i * shentsize)
        secs.append((name, off, size))
    stro = secs[shstrndx][1]
    res = {}
    for name, off, size in secs:
        n = d[stro + name: d.index(b'\0', stro + name)].decode()
        if n.startswith('.text.'):
            res[n[6:]] = d[off:off + size]
    return res

rb, ra = report(sys.argv[1]), report(sys.argv[2])
tb, ta = texts(sys.argv[3]), texts(sys.argv[4])
keys = ['regs', 'bars', 'stack', 'spill_st', 'spill_ld', 'smem', 'cmem0']
same_res = same_bytes = 0
worse = []
print(f"{'kernel':52} {'regs':>9} {'stack':>7} {'spill':>9} {'instrs':>13} sass")
for k in sorted(set(rb) | set(ra)):
    b, a = rb.get(k, {}), ra.get(k, {})
    eq = all(b.get(x) == a.get(x) for x in keys)
    same_res += eq
    ib, ia = len(tb.get(k, b'')) // 16, len(ta.get(k, b'')) // 16
    ident = tb.get(k) == ta.get(k)
    same_bytes += ident
    flag = '' if eq else '  <-- resources differ'
    if not eq and (a.get('regs', 0) > b.get('regs', 0) or a.get('spill_st', 0) > b.get('spill_st', 0)
                   or a.get('stack', 0) > b.get('stack', 0)):
        worse.append(k)
    print(f"{k:52} {b.get('regs')!s:>4}/{a.get('regs')!s:<4} {b.get('stack')!s:>3}/{a.get('stack')!s:<3} "
          f"{b.get('spill_st',0)+b.get('spill_ld',0)!s:>4}/{a.get('spill_st',0)+a.get('spill_ld',0)!s:<4} "
          f"{ib:>6}/{ia:<6} {'identical' if ident else 'DIFFERENT'}{flag}")
n = len(set(rb) | set(ra))
print(f"\n{n} kernels; resources identical: {same_res}; SASS bytes identical: {same_bytes}; worse: {worse}")
