"""MNIST / Fashion-MNIST from the official IDX ``.gz`` files (no torchvision, no pickle).

Files are looked up in ``DIR/<dataset>/`` or directly in ``DIR`` (the layout of ``../shared/data/images``
and of the user cache). When no directory is given, the per-user cache (``$CRISPEDIT_CACHE`` or
``~/.cache/crispedit/datasets``) is used and missing files are downloaded from the official mirrors with
an md5 check. Every problem a user can cause (missing directory, missing or truncated file, bad
checksum, offline) raises :class:`~crispedit.errors.CrispEditError` with a one-line message.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import struct
import urllib.request
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from ..atomic import atomic_write_bytes
from ..errors import CrispEditError
from ..paths import check_input_dir

__all__ = ["DATASETS", "ImageSplit", "load_idx", "load_dataset", "default_cache_dir", "resolve_data_dir"]

_SPLIT_FILES = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}

# name -> (download base urls, {file: md5})
DATASETS: dict[str, tuple[tuple[str, ...], dict[str, str]]] = {
    "mnist": (
        ("https://ossci-datasets.s3.amazonaws.com/mnist/", "https://storage.googleapis.com/cvdf-datasets/mnist/"),
        {
            "train-images-idx3-ubyte.gz": "f68b3c2dcbeaaa9fbdd348bbdeb94873",
            "train-labels-idx1-ubyte.gz": "d53e105ee54ea40749a09fcbcd1e9432",
            "t10k-images-idx3-ubyte.gz": "9fb629c4189551a2d022fa330f9573f3",
            "t10k-labels-idx1-ubyte.gz": "ec29112dd5afa0611ce80d1b7f02629c",
        },
    ),
    "fashion_mnist": (
        ("http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",),
        {
            "train-images-idx3-ubyte.gz": "8d4fb7e6c68d591d4c3dfef9ec88bf0d",
            "train-labels-idx1-ubyte.gz": "25c81989df183df01b3e8a0aad5dffbe",
            "t10k-images-idx3-ubyte.gz": "bef4ecab320f06d8554ea6380940ec79",
            "t10k-labels-idx1-ubyte.gz": "bb300cfdad3c16e7a12a480ee83cd310",
        },
    ),
}

_DTYPES = {
    0x08: np.uint8,
    0x09: np.int8,
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}


@dataclass
class ImageSplit:
    """Images as float32 ``N x 1 x 28 x 28`` in [0, 1] and int64 labels."""

    images: Tensor
    labels: Tensor

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def subset(self, n: int | None, seed: int = 0) -> ImageSplit:
        """A seeded random subset of ``n`` examples (everything when ``n`` is None or too large)."""
        if n is None or n >= len(self):
            return self
        idx = torch.randperm(len(self), generator=torch.Generator().manual_seed(seed))[:n]
        return ImageSplit(self.images[idx], self.labels[idx])


def load_idx(path: str | os.PathLike) -> np.ndarray:
    """Parse one (gzipped) IDX file into a numpy array."""
    path = Path(path)
    if not path.is_file():
        raise CrispEditError(f"IDX file not found: {path}")
    try:
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rb") as fh:
            raw = fh.read()
    except (OSError, EOFError, zlib.error) as exc:
        raise CrispEditError(f"cannot read IDX file {path}: {exc} (truncated or corrupt?)") from None
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _DTYPES:
        raise CrispEditError(f"{path} is not an IDX file (bad magic number)")
    ndim = raw[3]
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise CrispEditError(f"IDX file {path} is truncated (incomplete header)")
    shape = struct.unpack(f">{ndim}I", raw[4:header])
    dtype = np.dtype(_DTYPES[raw[2]])
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if len(raw) - header != expected:
        raise CrispEditError(
            f"IDX file {path} is truncated or padded: {len(raw) - header} data bytes, "
            f"expected {expected} for shape {tuple(shape)}"
        )
    return np.frombuffer(raw, dtype=dtype, offset=header).reshape(shape)


def default_cache_dir() -> Path:
    """Where downloaded IDX datasets are kept: ``$CRISPEDIT_CACHE/datasets``, else
    ``$XDG_CACHE_HOME/crispedit/datasets`` (``~/.cache`` by default)."""
    root = os.environ.get("CRISPEDIT_CACHE")
    base = Path(root) if root else Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "crispedit"
    return base / "datasets"


def _md5(path: Path) -> str:
    h = hashlib.md5()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _download(name: str, fname: str, dest: Path, timeout: float = 30.0) -> None:
    urls, md5s = DATASETS[name]
    errors = []
    for base in urls:
        try:
            with urllib.request.urlopen(base + fname, timeout=timeout) as resp:  # noqa: S310 (fixed https/http mirrors)
                data = resp.read()
        except OSError as exc:
            errors.append(f"{base}: {getattr(exc, 'reason', exc)}")
            continue
        if hashlib.md5(data).hexdigest() != md5s[fname]:
            errors.append(f"{base}: md5 mismatch")
            continue
        atomic_write_bytes(dest, data)
        return
    raise CrispEditError(
        f"cannot download {name}/{fname} (offline?); pass --data DIR with the IDX files. Tried: {'; '.join(errors)}"
    )


def resolve_data_dir(data_dir: str | os.PathLike | None, name: str, download: bool = True) -> Path:
    """Directory holding the four IDX files of ``name``.

    With ``data_dir`` given, ``data_dir/name`` or ``data_dir`` itself must hold them (no download).
    Without it, the user cache is used and missing files are downloaded (md5-checked).
    """
    if name not in DATASETS:
        raise CrispEditError(f"unknown dataset {name!r}; choose from {sorted(DATASETS)}")
    files = [f for pair in _SPLIT_FILES.values() for f in pair]
    if data_dir is not None:
        root = check_input_dir(Path(data_dir).expanduser(), "data directory")
        for cand in (root / name, root):
            if all((cand / f).is_file() for f in files):
                return cand
        missing = [f for f in files if not (root / name / f).is_file()]
        raise CrispEditError(f"{root}/{name} lacks {', '.join(missing)} (expected the official IDX .gz files)")
    cache = default_cache_dir() / name
    for f in files:
        target = cache / f
        if target.is_file() and _md5(target) == DATASETS[name][1][f]:
            continue
        if not download:
            raise CrispEditError(f"{target} is missing; pass --data DIR with the IDX files")
        _download(name, f, target)
    return cache


def load_dataset(name: str, split: str, data_dir: str | os.PathLike | None = None, download: bool = True) -> ImageSplit:
    """Load ``split`` ("train" or "test") of ``name`` ("mnist" or "fashion_mnist")."""
    if split not in _SPLIT_FILES:
        raise CrispEditError(f"unknown split {split!r}; choose 'train' or 'test'")
    root = resolve_data_dir(data_dir, name, download=download)
    img_file, lbl_file = _SPLIT_FILES[split]
    images = load_idx(root / img_file)
    labels = load_idx(root / lbl_file)
    if images.ndim != 3 or labels.ndim != 1 or images.shape[0] != labels.shape[0]:
        raise CrispEditError(f"{root}: images {images.shape} and labels {labels.shape} do not match")
    x = torch.from_numpy(images.astype(np.float32) / 255.0).unsqueeze(1)
    y = torch.from_numpy(labels.astype(np.int64))
    if int(y.min()) < 0 or int(y.max()) > 9:
        raise CrispEditError(f"{root / lbl_file}: labels outside 0..9")
    return ImageSplit(x, y)
