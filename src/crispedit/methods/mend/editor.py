"""MEND (Mitchell et al. 2022, "Fast Model Editing at Scale"): a meta-trained gradient-transform network
turns one gradient of the edit requests into the weight update of every edit layer.

The editor loads the network trained for this model and these layers (option ``weights``; default the
cached one, :func:`~.net.default_weights_path`), computes the factors ``(u, δ)`` of all requests on the
unedited model in one gradient computation (:func:`~.net.edit_factors`: chunks of ``batch_size``
requests, the same rows as one batch), and adds ``ΔW_l = −α_l Σ_t δ̃_t ũ_tᵀ`` to each edit layer's weight.
No training happens here: train the network first with ``crispedit mend train`` (or
:func:`~.train.train_mend`) on edit requests disjoint from the evaluated ones.

Edit layers: ``--layers``, else the layers stored in the ``weights`` file, else MEND's default — the MLP
matrices of the last three decoder blocks (:func:`~.net.default_layers`). Options:
:class:`~crispedit.methods.mend.MENDConfig`.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from torch import nn

from ...editing.editor import EditContext
from ...editing.single_pass import SinglePassEditor
from ...errors import CrispEditError
from ...layers import resolve_layers
from ...weights import weight_fingerprint
from . import MENDConfig
from .net import (
    default_layers,
    default_weights_path,
    edit_factors,
    load_network,
    prompt_digests,
    read_network_meta,
    train_command_hint,
)

__all__ = ["MENDConfig", "MENDEditor", "network_path"]


def network_path(model: nn.Module, layers: dict[str, nn.Module], cfg: MENDConfig, fingerprint: str | None = None):
    """The network file the editor uses: ``cfg.weights`` when set, else the default cache location for this
    model's fingerprint and ``layers``."""
    if cfg.weights:
        return cfg.weights
    return default_weights_path(fingerprint or weight_fingerprint(model), list(layers))


class MENDEditor(SinglePassEditor):
    """MEND: a trained gradient transform applied to one gradient of the requests (no iterations). The history's
    ``epoch_loss`` holds the mean target NLL (nats/token, bare prompt) before and after; ``steps`` 1."""

    name = "mend"
    base_only = True  # the network was trained for the unedited model's weights

    def select_layers(self, model, config):
        """``--layers``; else those of the ``weights`` file; else the MLP linears of the last 3 blocks."""
        if config.layers:
            return resolve_layers(model, config.layers)
        cfg: MENDConfig = config.method_config
        if cfg.weights:
            return resolve_layers(model, ",".join(read_network_meta(cfg.weights)["layers"]))
        return resolve_layers(model, ",".join(default_layers(model)))

    def check_ready(self, model, config):
        """The network for this model and these layers exists and loads (one-line error otherwise)."""
        self._network(model, self.select_layers(model, config), config.method_config)

    def input_files(self, model, config):
        """``{"weights": the network file}`` (``--mend-weights``, else the default cache file)."""
        return {"weights": self._network_file(model, self.select_layers(model, config), config.method_config)}

    def _network_file(self, model, layers, cfg: MENDConfig, fingerprint: str | None = None) -> Path:
        """:func:`network_path`; a missing default file is a one-line error that says how to train one."""
        path = Path(network_path(model, layers, cfg, fingerprint))
        if not cfg.weights and not path.is_file():
            raise CrispEditError(
                f"no trained MEND network for this model and layers (looked for {path}); train one "
                f"with `{train_command_hint()}` or pass --mend-weights FILE"
            )
        return path

    def _network(self, model, layers, cfg: MENDConfig):
        """The trained network for ``model`` and ``layers`` (``cfg.weights`` or the default cache file), checked."""
        fp = weight_fingerprint(model)
        return load_network(self._network_file(model, layers, cfg, fp), layers, model_fingerprint=fp)

    def start(self, model, tokenizer, requests, ctx: EditContext) -> dict:
        """Load the network (on the model's device) and count the requests it was trained on (a warning when
        any were)."""
        net = self._network(model, ctx.layers, ctx.config.method_config)
        net.to(next(model.parameters()).device)
        seen = set(net.meta.get("training", {}).get("request_digests") or [])
        overlap = sum(d in seen for d in prompt_digests(requests))
        if overlap:
            warnings.warn(
                f"mend: {overlap} of the {len(requests)} edit requests were in the network's training slice; "
                "evaluate on requests disjoint from it",
                stacklevel=3,
            )
        return {"net": net, "overlap": overlap, "deltas": {}}

    def updates(self, model, tokenizer, requests, ctx: EditContext, state: dict, history):
        """Every request's factors on the unedited model, then each layer's ``ΔW`` from them."""
        cfg: MENDConfig = ctx.config.method_config
        layers, net = ctx.layers, state["net"]
        history.contexts = ["bare"]
        factors = edit_factors(model, tokenizer, list(requests), layers, batch_size=cfg.batch_size)
        with torch.no_grad():
            state["deltas"] = {n: net.delta(n, U, D) for n, (U, D) in factors.items()}
        for n in layers:
            yield n, state["deltas"][n]
        history.steps = 1
        history.sequences = len(requests)
        history.tokens = sum(int(U.shape[0]) for U, _ in factors.values()) // max(len(layers), 1)

    def stats(self, layers, state):
        """Per layer: the network's step ``alpha``, the norm of ``ΔW``, and how many requests it was trained on."""
        alpha = state["net"].alpha.detach().cpu().tolist()
        return {
            n: {
                "kept_fraction": 1.0,
                "form": "mend",
                "alpha": alpha[i],
                "delta_norm": float(state["deltas"][n].norm()),
                "train_overlap": state["overlap"],
            }
            for i, n in enumerate(layers)
        }
