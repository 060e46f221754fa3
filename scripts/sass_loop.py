#!/usr/bin/env python3
"""SASS of a kernel's main loop, as counted in kernels-gpu/src/prefill/DESIGN.md.

usage: sass_loop.py CUBIN KERNEL [--dump]    (CUBIN: target/ptx-check.cubin of `cargo xtask ptx`)

The loop is the largest backward branch whose body contains HMMA. Prints its length, its
HMMA / LDSM / MUFU.EX2 / LDL / STL counts and, per LDSM kind (M88: Q and K, MT88: V), how many
HMMA issue between a load and the first instruction that reads its registers ("ahead"; 0 = the
consumer waits for the load). nvdisasm: $NVDISASM, else on PATH.
"""
import os
import re
import shutil
import subprocess
import sys


def opcode(ins):
    return ins.split()[1] if ins.startswith("@") else ins.split()[0]


def functions(cubin):
    nvdisasm = os.environ.get("NVDISASM") or shutil.which("nvdisasm") or "nvdisasm"
    text = subprocess.run([nvdisasm, "-c", cubin], capture_output=True, text=True, check=True).stdout
    funcs, labels, cur, pending = {}, {}, None, []
    for line in text.splitlines():
        m = re.match(r"\s*\.text\.(\S+):", line)
        if m:
            cur = m.group(1)
            funcs[cur], labels[cur] = [], {}
            continue
        m = re.match(r"^(\.L_x_\d+):", line.strip())
        if m and cur:
            pending.append(m.group(1))
            continue
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if m and cur:
            addr = int(m.group(1), 16)
            for label in pending:
                labels[cur][label] = addr
            pending = []
            funcs[cur].append((addr, m.group(2).strip()))
    return funcs, labels


def main_loop(ins, labels):
    index = {a: i for i, (a, _) in enumerate(ins)}
    best = []
    for i, (addr, text) in enumerate(ins):
        m = re.search(r"`\((\.L_x_\d+)\)", text)
        if opcode(text) != "BRA" or not m or labels[m.group(1)] >= addr:
            continue
        body = ins[index[labels[m.group(1)]] : i + 1]
        if any(opcode(x).startswith("HMMA") for _, x in body) and len(body) > len(best):
            best = body
    return [x for _, x in best], best


def ahead(body):
    result = {"M88": [], "MT88": []}
    for i, ins in enumerate(body):
        if not opcode(ins).startswith("LDSM"):
            continue
        dest = int(re.search(r"LDSM\S*\s+R(\d+)", ins).group(1))
        dest = set(range(dest, dest + 4))
        hmma = 0
        for later in body[i + 1 :]:
            fields = later.split(None, 2 if later.startswith("@") else 1)
            operands = fields[-1].split(",")[1:] if len(fields) > (2 if later.startswith("@") else 1) else []
            if {int(r) for r in re.findall(r"\bR(\d+)\b", ",".join(operands))} & dest:
                result["MT88" if "MT88" in ins else "M88"].append(hmma)
                break
            hmma += opcode(later).startswith("HMMA")
    return result


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    funcs, labels = functions(sys.argv[1])
    kernel = sys.argv[2]
    body, with_addr = main_loop(funcs[kernel], labels[kernel])
    count = lambda p: sum(opcode(x).startswith(p) for x in body)
    print(f"{kernel}: loop {len(body)}, HMMA {count('HMMA')}, LDSM {count('LDSM')}, "
          f"EX2 {sum(opcode(x) == 'MUFU.EX2' for x in body)}, LDL {count('LDL')}, STL {count('STL')}")
    for kind, dist in ahead(body).items():
        if dist:
            print(f"  LDSM {kind}: {len(dist)} loads, HMMA between load and first use: "
                  f"mean {sum(dist) / len(dist):.1f}, used at once {dist.count(0)}")
    if "--dump" in sys.argv:
        for addr, text in with_addr:
            print(f"{addr:05x}  {text}")


if __name__ == "__main__":
    main()
