"""Small-scale curvature study (paper section 4.1): MNIST -> Fashion-MNIST.

Pre-train a small bias-free LeNet-5 on MNIST (the capability), then fine-tune it on Fashion-MNIST (the
edit) with projected SGD in the gamma-approximate nullspace of a curvature model of the MNIST
training loss, for ``gamma = 1 - 10^-k`` over a sweep of ``k``, and for each curvature model:

=================  ==============================================================================
``hessian``        exact Hessian of the loss on the curvature subset, whole parameter vector; negative
                   eigenvalues are clamped to 0, so negative-curvature directions count as flat (kept)
``hessian_abs``    the same Hessian ranked by ``|lambda|``: strongly negative directions are masked too
``ggn``            exact Gauss-Newton matrix ``E[J^T H J]`` (= Hessian of the Bregman divergence)
``kfac``           K-FAC ``A (x) S`` per layer (exact label expectation), layer-wise projector
``ekfac``          K-FAC eigenbasis with re-fitted (per-example) eigenvalues, layer-wise
``activation_cov`` Adam-NSCL: eigenbasis of the layer-input covariance ``A`` only, layer-wise
``none``           unprojected fine-tuning (one point, no gamma)
=================  ==============================================================================

Whenever the parameters have moved by more than ``recompute_drift`` (relative L2 norm) since the
projector was last computed, the curvature is recomputed at the current parameters (on the same
MNIST subset) and the projector rebuilt, as in the paper. The curvature at the pre-trained weights
is computed once per method and shared by all gammas.

Outputs in ``out_dir``: ``results.json`` (config, environment, pre-training, curvature costs, table),
``results.csv`` (the table) and ``tradeoff.png``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm.auto import tqdm

from ..atomic import atomic_write_json
from ..paths import check_output_dir
from ..versions import environment
from .idx_data import ImageSplit, load_dataset
from .mnist_config import METHODS, MnistStudyConfig, gamma_of
from .study_curvature import NoProjection, ParamProjector, compute_curvature, hessian_at

__all__ = [
    "METHODS",
    "MnistStudyConfig",
    "gamma_of",
    "SmallLeNet",
    "run_mnist_study",
    "format_table",
]

METHOD_LABELS = {
    "hessian": "Hessian (exact)",
    "hessian_abs": "|Hessian| (exact)",
    "ggn": "Gauss-Newton (exact)",
    "kfac": "K-FAC",
    "ekfac": "EK-FAC",
    "activation_cov": "activation covariance (Adam-NSCL)",
    "none": "unprojected fine-tuning",
}
MNIST_MEAN, MNIST_STD = 0.1307, 0.3081


# -----------------------------------------------------------------------------------------------
# network


class SmallLeNet(nn.Module):
    """LeNet-5 narrowed so its dense Hessian is cheap (4 212 parameters by default), bias-free.

    Biases are left out so that every layer is a plain ``W a`` (K-FAC needs no homogeneous
    coordinate) and the network output is linear in each weight for fixed others (ReLU, max-pool),
    which :func:`~crispedit.experiments.exact_curvature.hessian_matrix` exploits.
    """

    def __init__(self, conv1_channels: int = 4, conv2_channels: int = 8, hidden: int = 24, n_classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(1, conv1_channels, 5, bias=False)
        self.conv2 = nn.Conv2d(conv1_channels, conv2_channels, 5, bias=False)
        self.fc1 = nn.Linear(conv2_channels * 16, hidden, bias=False)
        self.fc2 = nn.Linear(hidden, n_classes, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        """Logits (``batch x n_classes``) of images ``x`` (``batch x 1 x 28 x 28``)."""
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))

    @property
    def layer_names(self) -> list[str]:
        """Names of the trainable layers (convolutions and linear), input to output."""
        return ["conv1", "conv2", "fc1", "fc2"]


def _normalise(split: ImageSplit) -> ImageSplit:
    return ImageSplit((split.images - MNIST_MEAN) / MNIST_STD, split.labels)


@torch.no_grad()
def accuracy(model: nn.Module, split: ImageSplit, batch: int = 2000) -> float:
    """Classification accuracy (0-1) of ``model`` on ``split`` in eval mode, restored after."""
    was = model.training
    model.eval()
    correct = 0
    for i in range(0, len(split), batch):
        correct += int((model(split.images[i : i + batch]).argmax(-1) == split.labels[i : i + batch]).sum())
    model.train(was)
    return correct / max(1, len(split))


def pretrain(model: nn.Module, data: ImageSplit, cfg: MnistStudyConfig, progress: bool | None) -> None:
    """Train ``model`` on the pretraining task (cross-entropy, Adam, ``cfg``'s epochs and batch size), in place."""
    gen = torch.Generator().manual_seed(cfg.seed)
    steps_per_epoch = max(1, len(data) // cfg.pretrain_batch)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.pretrain_lr)
    sched = torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=cfg.pretrain_lr, total_steps=cfg.pretrain_epochs * steps_per_epoch
    )
    model.train()
    bar = tqdm(
        total=cfg.pretrain_epochs * steps_per_epoch,
        desc="pre-train MNIST",
        unit="step",
        disable=None if progress is None else not progress,
    )
    for _ in range(cfg.pretrain_epochs):
        perm = torch.randperm(len(data), generator=gen)
        for i in range(steps_per_epoch):
            idx = perm[i * cfg.pretrain_batch : (i + 1) * cfg.pretrain_batch]
            loss = F.cross_entropy(model(data.images[idx]), data.labels[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            bar.update(1)
    bar.close()


# -----------------------------------------------------------------------------------------------
# projected fine-tuning


def _flat(model: nn.Module) -> Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def finetune(
    model: nn.Module,
    data: ImageSplit,
    cfg: MnistStudyConfig,
    make_projector: Callable[[], ParamProjector],
    progress: bool | None = None,
    desc: str = "fine-tune",
) -> dict:
    """Projected SGD on ``data``; ``make_projector()`` builds a projector at the current weights.

    Returns the projector's kept dimensions at the start, the number of recomputations and the
    largest drift seen.
    """
    gen = torch.Generator().manual_seed(cfg.seed + 1)  # same batches for every method
    projector = make_projector()
    kept0 = projector.kept_dims
    ref = _flat(model)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.finetune_lr, momentum=cfg.finetune_momentum)
    recomputes, drift_max = 0, 0.0
    model.train()
    perm = torch.randperm(len(data), generator=gen)
    pos = 0
    for _ in tqdm(
        range(cfg.finetune_steps),
        desc=desc,
        unit="step",
        leave=False,
        disable=None if progress is None else not progress,
    ):
        if pos + cfg.finetune_batch > len(data):
            perm, pos = torch.randperm(len(data), generator=gen), 0
        idx = perm[pos : pos + cfg.finetune_batch]
        pos += cfg.finetune_batch
        loss = F.cross_entropy(model(data.images[idx]), data.labels[idx])
        opt.zero_grad(set_to_none=False)
        loss.backward()
        projector.project_(model)
        opt.step()
        if isinstance(projector, NoProjection):
            continue
        drift = float((_flat(model) - ref).norm() / ref.norm())
        drift_max = max(drift_max, drift)
        if drift > cfg.recompute_drift and recomputes < cfg.max_recomputes:
            projector = make_projector()
            ref = _flat(model)
            opt = torch.optim.SGD(model.parameters(), lr=cfg.finetune_lr, momentum=cfg.finetune_momentum)
            recomputes += 1
    return {"kept_dims": kept0, "recomputes": recomputes, "max_drift": drift_max}


# -----------------------------------------------------------------------------------------------
# the study


def _row(
    method: str,
    k: float | None,
    mnist: float,
    fashion: float,
    kept: int,
    n_params: int,
    seconds: float,
    recomputes: int = 0,
) -> dict:
    return {
        "method": method,
        "k": k,
        "gamma": None if k is None else gamma_of(k),
        "mnist_acc": round(mnist, 4),
        "fashion_acc": round(fashion, 4),
        "kept_dims": kept,
        "kept_fraction": round(kept / n_params, 5),
        "recomputes": recomputes,
        "seconds": round(seconds, 2),
    }


@dataclasses.dataclass
class _Splits:
    """The study's images (normalised): the MNIST and Fashion-MNIST training sets and a seeded test subset of
    ``cfg.eval_samples`` images of each."""

    mnist_train: ImageSplit
    mnist_test: ImageSplit
    fashion_train: ImageSplit
    fashion_test: ImageSplit

    @classmethod
    def load(cls, cfg: MnistStudyConfig) -> _Splits:
        """Read the four splits from ``cfg.data_dir`` (downloaded when missing), in this order."""
        mnist_train = _normalise(load_dataset("mnist", "train", cfg.data_dir))
        mnist_test = _normalise(load_dataset("mnist", "test", cfg.data_dir)).subset(cfg.eval_samples, cfg.seed)
        fashion_train = _normalise(load_dataset("fashion_mnist", "train", cfg.data_dir))
        fashion_test = _normalise(load_dataset("fashion_mnist", "test", cfg.data_dir))
        fashion_test = fashion_test.subset(cfg.eval_samples, cfg.seed)
        return cls(mnist_train, mnist_test, fashion_train, fashion_test)


def _pretrained(model: SmallLeNet, splits: _Splits, cfg: MnistStudyConfig, progress, log) -> dict:
    """Pre-train ``model`` on MNIST and measure it: ``{"mnist_acc", "fashion_acc"}`` (test accuracies) and
    ``"seconds"``; a warning line when MNIST stays below ``cfg.target_accuracy``."""
    t0 = time.perf_counter()
    pretrain(model, splits.mnist_train.subset(cfg.pretrain_samples, cfg.seed), cfg, progress)
    pre = {
        "mnist_acc": accuracy(model, splits.mnist_test),
        "fashion_acc": accuracy(model, splits.fashion_test),
        "seconds": round(time.perf_counter() - t0, 2),
    }
    log(
        f"pre-trained: MNIST test acc {pre['mnist_acc']:.4f}, Fashion test acc {pre['fashion_acc']:.4f} "
        f"({pre['seconds']:.0f}s)"
    )
    if pre["mnist_acc"] < cfg.target_accuracy:
        log(f"warning: pre-training reached {pre['mnist_acc']:.4f} < target {cfg.target_accuracy}")
    return pre


class _Study:
    """One study under way from the pre-trained ``model`` (its weights ``theta0``): the rows so far (accuracies,
    kept dimensions, seconds), the curvature's seconds and spectrum per method, the results payload
    (:meth:`payload`, also written as ``results.partial.json`` after every row)."""

    def __init__(
        self,
        cfg: MnistStudyConfig,
        model: SmallLeNet,
        splits: _Splits,
        pre: dict,
        t_start: float,
        progress: bool | None,
        log: Callable[[str], None],
    ):
        self.cfg, self.model, self.splits, self.pre, self.t_start = cfg, model, splits, pre, t_start
        self.progress, self.log, self.out_dir = progress, log, Path(cfg.out_dir)
        self.n_params = sum(p.numel() for p in model.parameters())
        self.theta0 = {k: v.clone() for k, v in model.state_dict().items()}
        self.curv_data = splits.mnist_train.subset(cfg.curvature_samples, cfg.seed + 2)
        self.rows = [_row("pretrained", None, pre["mnist_acc"], pre["fashion_acc"], 0, self.n_params, 0.0)]
        self.curvature_info: dict[str, dict] = {}
        self.hessian0: Tensor | None = None  # the Hessian at the pre-trained weights, shared by hessian and hessian_abs

    def payload(self, done: bool) -> dict:
        """The study's results payload so far (``complete``: ``done``): config, environment, network, rows."""
        return {
            "study": "mnist_to_fashion_mnist_curvature",
            "complete": done,
            "config": dataclasses.asdict(self.cfg),
            "environment": environment(),
            "network": {
                "class": "SmallLeNet",
                "parameters": self.n_params,
                "shapes": {n: list(p.shape) for n, p in self.model.named_parameters()},
            },
            "pretrained": self.pre,
            "curvature": self.curvature_info,
            "rows": self.rows,
            "total_seconds": round(time.perf_counter() - self.t_start, 1),
        }

    def _finetune_row(self, method: str, k: float | None, make_projector, kept: int | None = None) -> None:
        """Fine-tune from ``theta0``'s copy in the model on Fashion-MNIST under ``make_projector`` and add its row
        (``kept``: the kept dimensions to report instead of the projector's); the partial results are written."""
        t0 = time.perf_counter()
        desc = "fine-tune (none)" if k is None else f"fine-tune ({method}, k={k:g})"
        info = finetune(self.model, self.splits.fashion_train, self.cfg, make_projector, self.progress, desc)
        self.rows.append(
            _row(
                method,
                k,
                accuracy(self.model, self.splits.mnist_test),
                accuracy(self.model, self.splits.fashion_test),
                info["kept_dims"] if kept is None else kept,
                self.n_params,
                time.perf_counter() - t0,
                info["recomputes"] if kept is None else 0,
            )
        )
        self.log(_format_row(self.rows[-1]))
        atomic_write_json(self.out_dir / "results.partial.json", self.payload(False))  # inspectable as it goes

    def run_method(self, method: str) -> None:
        """Add ``method``'s rows: plain fine-tuning for ``none``; else its curvature at ``theta0`` (seconds and
        spectrum recorded), then one projected fine-tuning per ``k`` of ``cfg.k_values``."""
        cfg, model = self.cfg, self.model
        model.load_state_dict(self.theta0)
        if method == "none":
            return self._finetune_row("none", None, lambda: NoProjection(self.n_params), kept=self.n_params)
        t0 = time.perf_counter()
        is_hessian = method in ("hessian", "hessian_abs")
        if is_hessian and self.hessian0 is None:
            self.hessian0 = hessian_at(model, self.curv_data, cfg, self.progress)
        curv0 = compute_curvature(
            method,
            model,
            self.curv_data,
            cfg,
            self.progress,
            count_negative=True,
            hessian=self.hessian0 if is_hessian else None,
        )
        info = self.curvature_info[method] = {"seconds_at_theta0": round(time.perf_counter() - t0, 2)}
        if curv0.spectrum is not None:
            info["spectrum"] = curv0.spectrum
        self.log(f"{method}: curvature at the pre-trained weights in {info['seconds_at_theta0']:.1f}s")
        for k in cfg.k_values:
            gamma = gamma_of(k)
            model.load_state_dict(self.theta0)
            first = [True]

            def make_projector(first: list = first, gamma: float = gamma) -> ParamProjector:
                """The projector at ``gamma``: first from the curvature at the pre-trained weights, then from
                curvature recomputed at the current weights."""
                if first[0]:  # the shared curvature at the pre-trained weights
                    first[0] = False
                    return curv0.projector(gamma)
                return compute_curvature(method, model, self.curv_data, cfg, progress=False).projector(gamma)

            self._finetune_row(method, k, make_projector)

    def finish(self) -> dict:
        """Write ``results.json``, ``results.csv`` and ``tradeoff.png``, drop the partial file; the final payload
        with the ``files`` written."""
        from .study_report import write_csv, write_plot

        final, out_dir = self.payload(True), self.out_dir
        atomic_write_json(out_dir / "results.json", final)
        write_csv(out_dir / "results.csv", self.rows)
        write_plot(
            out_dir / "tradeoff.png", self.rows, title=f"MNIST → Fashion-MNIST, SmallLeNet ({self.n_params} parameters)"
        )
        (out_dir / "results.partial.json").unlink(missing_ok=True)
        final["files"] = {
            "json": str(out_dir / "results.json"),
            "csv": str(out_dir / "results.csv"),
            "png": str(out_dir / "tradeoff.png"),
        }
        return final


def run_mnist_study(
    cfg: MnistStudyConfig, progress: bool | None = None, log: Callable[[str], None] | None = print
) -> dict:
    """Run the study, write ``results.json``, ``results.csv`` and ``tradeoff.png`` to ``cfg.out_dir``
    and return the JSON report (a dict)."""
    cfg = cfg.validate()
    check_output_dir(cfg.out_dir)  # an unwritable --out fails now, not after the whole study
    log = log or (lambda s: None)
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    t_start = time.perf_counter()
    torch.manual_seed(cfg.seed)
    splits = _Splits.load(cfg)
    model = SmallLeNet(cfg.conv1_channels, cfg.conv2_channels, cfg.hidden)
    n_params = sum(p.numel() for p in model.parameters())
    log(
        f"network: {n_params} parameters (conv {cfg.conv1_channels}/{cfg.conv2_channels}, hidden {cfg.hidden}); "
        f"dense {n_params}x{n_params} float64 matrix = {8 * n_params**2 / 2**20:.0f} MiB"
    )
    study = _Study(cfg, model, splits, _pretrained(model, splits, cfg, progress, log), t_start, progress, log)
    for method in cfg.methods:
        study.run_method(method)
    return study.finish()


def _format_row(r: dict) -> str:
    k = "-" if r["k"] is None else f"{r['k']:g}"
    return (
        f"{r['method']:<15} k={k:<5} MNIST {r['mnist_acc']:.4f}  Fashion {r['fashion_acc']:.4f}  "
        f"kept {r['kept_dims']:>5}  recomputes {r['recomputes']}  {r['seconds']:.1f}s"
    )


def format_table(rows: Sequence[dict]) -> str:
    """The study rows as a fixed-width text table (one line per curvature and gamma)."""
    head = f"{'method':<15} {'k':>5} {'gamma':>12} {'MNIST':>7} {'Fashion':>8} {'kept':>6} {'recomp':>6} {'sec':>7}"
    lines = [head, "-" * len(head)]
    for r in rows:
        k = "" if r["k"] is None else f"{r['k']:g}"
        g = "" if r["gamma"] is None else f"{r['gamma']:.7f}"
        lines.append(
            f"{r['method']:<15} {k:>5} {g:>12} {r['mnist_acc']:>7.4f} {r['fashion_acc']:>8.4f} "
            f"{r['kept_dims']:>6} {r['recomputes']:>6} {r['seconds']:>7.1f}"
        )
    return "\n".join(lines)
