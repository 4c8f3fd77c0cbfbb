"""Generate packages/areal-proto from proto/ (the only way that code is made).

    uv run python scripts/gen_proto.py          # write the generated tree
    uv run python scripts/gen_proto.py --check  # exit 1 if it would differ

protoc emits absolute imports rooted at the proto path (`from areal.common.v1
import ...`). The generated tree is re-rooted under the import name
`areal_proto` (so `areal.router.v1` becomes `areal_proto.router.v1`), which
keeps it from colliding with an installed upstream `areal` package.
"""

from __future__ import annotations

import argparse
import filecmp
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
OUT_DIR = ROOT / "packages" / "areal-proto" / "src" / "areal_proto"
# Hand-written parts of the output package that generation must keep.
KEEP = {"__init__.py", "py.typed"}
KEEP_DIRS = {"service"}
IMPORT_RE = re.compile(r"^(\s*)(from|import) areal\.", re.MULTILINE)


def generate(dest: Path) -> None:
    protos = sorted(str(p.relative_to(PROTO_DIR)) for p in PROTO_DIR.rglob("*.proto"))
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp)
        bindir = Path(sys.executable).parent
        cmd = [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{PROTO_DIR}",
            f"--python_out={raw}",
            f"--grpc_python_out={raw}",
            f"--plugin=protoc-gen-mypy={bindir / 'protoc-gen-mypy'}",
            f"--plugin=protoc-gen-mypy_grpc={bindir / 'protoc-gen-mypy_grpc'}",
            f"--mypy_out={raw}",
            f"--mypy_grpc_out={raw}",
            *protos,
        ]
        # protoc-gen-mypy chats on stderr; show it only when generation fails.
        done = subprocess.run(cmd, cwd=PROTO_DIR, capture_output=True, text=True)
        if done.returncode != 0:
            sys.stderr.write(done.stdout + done.stderr)
            raise SystemExit(f"protoc failed with exit code {done.returncode}")
        src = raw / "areal"
        for path in sorted(src.rglob("*")):
            rel = path.relative_to(src)
            target = dest / rel
            if path.is_dir():
                target.mkdir(parents=True, exist_ok=True)
                continue
            text = path.read_text()
            text = IMPORT_RE.sub(r"\1\2 areal_proto.", text)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)
        for d in [dest, *[p for p in dest.rglob("*") if p.is_dir()]]:
            init = d / "__init__.py"
            if not init.exists():
                init.write_text("")


def generated_files(root: Path) -> set[str]:
    return {
        str(p.relative_to(root))
        for p in root.rglob("*")
        if p.is_file()
        and "__pycache__" not in p.parts
        and str(p.relative_to(root)) not in KEEP
        and p.relative_to(root).parts[0] not in KEEP_DIRS
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="fail if the committed code differs")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        fresh = Path(tmp) / "areal_proto"
        fresh.mkdir()
        generate(fresh)
        new, old = generated_files(fresh), generated_files(OUT_DIR)
        if args.check:
            changed = sorted(
                (new ^ old)
                | {f for f in new & old if not filecmp.cmp(fresh / f, OUT_DIR / f, shallow=False)}
            )
            if changed:
                print("proto drift: regenerate with `uv run python scripts/gen_proto.py`:")
                for f in changed:
                    print(f"  packages/areal-proto/src/areal_proto/{f}")
                return 1
            print(f"proto: {len(new)} generated files match proto/")
            return 0
        for f in old - new:
            (OUT_DIR / f).unlink()
        for f in sorted(new):
            (OUT_DIR / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(fresh / f, OUT_DIR / f)
        print(f"proto: wrote {len(new)} files under packages/areal-proto/src/areal_proto")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
