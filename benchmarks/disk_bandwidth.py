#!/usr/bin/env python
"""The disk's read and write bandwidth, as `dd` with O_DIRECT sees it and as the project's disk
backend (`hf_slideformer.disk.make_backend("auto")`: kvikio where it imports and CUDA is there,
else positional POSIX I/O on threads) moves the layers' state.

    python benchmarks/disk_bandwidth.py --dir /tmp/bw --size-gib 8 [--json out/disk.json]

Each method writes a file of `--size-gib` GiB and then reads it back, in GB/s (1e9 bytes/s):
- dd: `dd if=/dev/zero of=F bs=16M oflag=direct conv=fsync`, then `dd if=F of=/dev/null bs=16M
  iflag=direct`: the disk itself, no page cache;
- backend: the state file's path: the file preallocated, then written from one aligned (pinned on
  CUDA) buffer of 256 MiB in 256 MiB requests, four in flight, and fsync'd; its pages are then
  dropped from the page cache (posix_fadvise DONTNEED), so that the read comes from the disk.

The disk placement's target is a share of the better of the two (docs/disk.md); the last line
names it.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402

from hf_slideformer.disk import aligned_host_buffer, make_backend, preallocate  # noqa: E402

CHUNK = 256 << 20             # bytes per backend request
IN_FLIGHT = 4                 # backend requests at once
DD_BLOCK = 16 << 20


def _drop_cache(path: str) -> None:
    """Drop the file's pages from the page cache, so that a read comes from the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def dd(path: str, nbytes: int) -> dict | None:
    """GB/s of `dd` writing and reading `path` with O_DIRECT; None where dd is missing or refuses it
    (a file system without O_DIRECT)."""
    if shutil.which("dd") is None:
        return None
    count = max(1, nbytes // DD_BLOCK)
    size = count * DD_BLOCK
    out = {}
    for name, argv in (("write", ["dd", "if=/dev/zero", f"of={path}", f"bs={DD_BLOCK}", f"count={count}",
                                  "oflag=direct", "conv=fsync"]),
                       ("read", ["dd", f"if={path}", "of=/dev/null", f"bs={DD_BLOCK}", "iflag=direct"])):
        t0 = time.perf_counter()
        proc = subprocess.run(argv, capture_output=True, text=True)
        dt = time.perf_counter() - t0
        if proc.returncode != 0:
            return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"rc {proc.returncode}"}
        out[f"{name}_gbs"] = size / dt / 1e9
    out["bytes"] = size
    return out


def backend(path: str, nbytes: int) -> dict:
    """GB/s of the disk backend writing then reading `path` (see the module's docstring)."""
    be = make_backend("auto")
    chunk = min(CHUNK, nbytes)
    size = max(1, nbytes // chunk) * chunk
    buf = aligned_host_buffer(chunk)
    buf.fill_(7)
    if torch.cuda.is_available():
        buf = buf.pin_memory()
    preallocate(path, size)
    f = be.open(path)
    try:
        out = {"backend": be.name, "bytes": size}
        for name in ("write", "read"):
            op = f.pwrite if name == "write" else f.pread
            t0 = time.perf_counter()
            pending = []
            for off in range(0, size, chunk):
                pending.append(op(buf, chunk, off))
                if len(pending) >= IN_FLIGHT:
                    pending.pop(0).result()
            for p in pending:
                p.result()
            if name == "write":
                f.sync()
            out[f"{name}_gbs"] = size / (time.perf_counter() - t0) / 1e9
            if name == "write":
                _drop_cache(path)
        return out
    finally:
        f.close()
        be.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", required=True, help="a directory on the disk to measure (created if missing)")
    ap.add_argument("--size-gib", type=float, default=8.0, help="bytes per file, GiB (default 8)")
    ap.add_argument("--json", default=None, help="write the figures here as JSON")
    args = ap.parse_args(argv)
    os.makedirs(args.dir, exist_ok=True)
    nbytes = int(args.size_gib * 2 ** 30)
    rows = {}
    for name, fn in (("dd (O_DIRECT)", dd), ("backend", backend)):
        path = os.path.join(args.dir, f"bandwidth-{os.getpid()}-{name.split()[0]}.bin")
        try:
            rows[name] = fn(path, nbytes)
        finally:
            if os.path.exists(path):
                os.remove(path)
    print(f"disk under {args.dir}, {nbytes / 2 ** 30:g} GiB per file")
    print("| method | write GB/s | read GB/s |")
    print("|---|---|---|")
    best = {}
    for name, r in rows.items():
        if not r or "error" in r:
            print(f"| {name} | - | - | {r['error'] if r else 'dd not found'}")
            continue
        label = f"{name}: {r['backend']}" if "backend" in r else name
        print(f"| {label} | {r['write_gbs']:.2f} | {r['read_gbs']:.2f} |")
        for k in ("write_gbs", "read_gbs"):
            best[k] = max(best.get(k, 0.0), r[k])
    if best:
        w, r = best['write_gbs'], best['read_gbs']
        # The state on disk is read and written in equal amounts, one after the other on one disk.
        best["plan_gbs"] = 2 * r * w / (r + w) if r and w else 0.0
        print(f"best: write {w:.2f} GB/s, read {r:.2f} GB/s; hf-slideformer plan --nvme-bw {best['plan_gbs']:.2f}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"rows": rows, "best": best}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
