#!/usr/bin/env python3
"""Peer numbers for lserve's benchmarks: torch SDPA (cuDNN and FlashAttention-2 back ends) on the
same shapes, in the same device run.

    python3 benches/torch_sdpa.py decode   # dense decode, Hq 32 / Hkv 8 / D 128, batch 1 and 16
    python3 benches/torch_sdpa.py prefill  # causal prefill, Hq 32 / Hkv 8 / D 128, bf16

Timing: CUDA events around each call, warm-up first, median of the timed runs. Decode K/V
working sets exceed the 60 MB L2 from 16K tokens on; smaller ones rotate over several buffers.
Prints one line per (back end, shape): median microseconds, and bandwidth (decode: bytes of K,
V, q and out over the time) or TFLOP/s (prefill: causal attention flops over the time), plus the
device-to-device copy bandwidth measured in the same run as the ceiling.
"""

import statistics
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

HQ, HKV, D = 32, 8, 128
DTYPE = torch.bfloat16
BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}


def median_us(fn, warmup=5, reps=30):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def copy_bandwidth():
    n = 1 << 30  # 1 GiB each way
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    us = median_us(lambda: dst.copy_(src))
    return 2 * n / (us * 1e-6) / 1e12


def decode(contexts=(4096, 16384, 65536, 131072, 262144), batches=(1, 16)):
    print(f"copy (device to device, read + write): {copy_bandwidth():.2f} TB/s")
    print("backend,batch,context,median_us,TB/s")
    for batch in batches:
        for ctx in contexts:
            kv_bytes = 2 * batch * HKV * ctx * D * 2
            rotate = max(1, (256 << 20) // kv_bytes)  # keep the working set past L2
            sets = []
            for _ in range(rotate):
                q = torch.randn(batch, HQ, 1, D, dtype=DTYPE, device="cuda")
                k = torch.randn(batch, HKV, ctx, D, dtype=DTYPE, device="cuda")
                v = torch.randn(batch, HKV, ctx, D, dtype=DTYPE, device="cuda")
                sets.append((q, k, v))
            for name, backend in BACKENDS.items():
                i = [0]

                def step():
                    q, k, v = sets[i[0] % rotate]
                    i[0] += 1
                    F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

                try:
                    with sdpa_kernel([backend]):
                        us = median_us(step)
                except RuntimeError as e:  # a back end that refuses the shape
                    print(f"{name},{batch},{ctx},unsupported,{str(e).splitlines()[0]}")
                    continue
                moved = kv_bytes + 2 * batch * HQ * D * 2
                print(f"{name},{batch},{ctx},{us:.1f},{moved / (us * 1e-6) / 1e12:.3f}")
            del sets
            torch.cuda.empty_cache()


def prefill(contexts=(4096, 16384, 32768, 65536, 131072)):
    print("backend,context,median_us,TFLOP/s")
    for ctx in contexts:
        q = torch.randn(1, HQ, ctx, D, dtype=DTYPE, device="cuda")
        k = torch.randn(1, HKV, ctx, D, dtype=DTYPE, device="cuda")
        v = torch.randn(1, HKV, ctx, D, dtype=DTYPE, device="cuda")
        flops = 4 * HQ * D * ctx * ctx / 2  # causal: half of QK^T and PV
        for name, backend in BACKENDS.items():
            try:
                with sdpa_kernel([backend]):
                    us = median_us(
                        lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
                        warmup=3,
                        reps=10,
                    )
            except RuntimeError as e:
                print(f"{name},{ctx},unsupported,{str(e).splitlines()[0]}")
                continue
            print(f"{name},{ctx},{us:.1f},{flops / (us * 1e-6) / 1e12:.1f}")
        del q, k, v
        torch.cuda.empty_cache()


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else "decode"
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    {"decode": decode, "prefill": prefill}[what]()
