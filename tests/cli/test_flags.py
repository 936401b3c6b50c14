"""The command-line flags are generated from the config dataclasses: every field a phase offers has its flag, the
defaults are the config's, and the parsed flags give back the config they describe."""

import argparse
from dataclasses import fields

import pytest

from crispedit.cli import build_parser
from crispedit.cli.flags import add_settings_args, config_from_args, settings_from_args
from crispedit.editing import EditConfig, SeqConfig
from crispedit.editing.phases import CurvatureConfig, DriftConfig, ProjectionConfig, SequencesConfig, TrainingConfig

EDIT = ["edit", "--edits", "x.json", "--out", "o"]


def _offered(cls) -> list[str]:
    return [f.name for f in fields(cls) if cls.metadata_of(f.name).get("cli", True) and cls.metadata_of(f.name)]


def test_every_phase_field_offered_has_a_flag_with_its_help():
    text = build_parser().parse_args(EDIT)  # parses: every generated flag has a usable default
    assert text.method == "crispedit"
    parser = argparse.ArgumentParser()
    for phase in (CurvatureConfig, ProjectionConfig, TrainingConfig, SequencesConfig, DriftConfig):
        add_settings_args(parser, phase)
    helped = parser.format_help()
    for phase in (CurvatureConfig, ProjectionConfig, TrainingConfig, SequencesConfig, DriftConfig):
        for name in _offered(phase):
            flag = phase.metadata_of(name).get("flag") or "--" + name.replace("_", "-")
            assert flag in helped, flag
            assert phase.help_of(name), name


def test_default_flags_give_the_default_config():
    args = build_parser().parse_args(EDIT)
    assert config_from_args(args) == EditConfig()


@pytest.mark.parametrize(
    "flags, expected",
    [
        (["--gamma", "0.9", "--projection", "update"], dict(gamma=0.9, projection_target="update")),
        (["--plateau", "0", "--epochs", "7", "--lr", "1e-3"], dict(plateau_epochs=0, epochs=7, lr=1e-3)),
        (
            ["--n-cap", "8", "--max-len", "32", "--label-mode", "empirical", "--cap-chat", "3", "--seed", "5"],
            dict(n_cap=8, max_len=32, label_mode="empirical", cap_chat=3, seed=5),
        ),
        (
            ["--keep-chat", "0", "--keep-subject", "2", "--keep-weight", "3", "--keep-tokens", "9"],
            dict(keep_chat=0, keep_subject=2, keep_weight=3.0, keep_tokens=9),
        ),
        (
            ["--contexts", "bare,chat", "--answer-end", "eos", "--context-sample", "2"],
            dict(contexts="bare,chat", answer_end="eos", context_sample=2),
        ),
        (
            ["--method", "ft", "--drift-penalty", "0.5", "--max-drift", "0.01"],
            dict(method="ft", drift_penalty=0.5, max_drift=0.01),
        ),
        (["--method", "lora", "--lora-r", "4"], dict(method="lora", options={"r": 4})),
    ],
)
def test_each_flag_sets_its_field(flags, expected):
    got = config_from_args(build_parser().parse_args(EDIT + flags))
    assert got == EditConfig(**expected)


def test_session_flags_give_the_session_config():
    base = ["session", "init", "--out", "s"]
    args = build_parser().parse_args(base)
    assert SeqConfig(**{**settings_from_args(args, SeqConfig), "edit": config_from_args(args)}) == SeqConfig()
    args = build_parser().parse_args(
        base
        + ["--no-carry-optimizer", "--mode", "batch", "--kl-texts", "4", "--edit-gamma", "0.9"]
        + ["--edit-factors", "target", "--replay", "20", "--check-earlier", "500"]
    )
    got = SeqConfig(**{**settings_from_args(args, SeqConfig), "edit": config_from_args(args)})
    assert got == SeqConfig(
        carry_optimizer=False,
        mode="batch",
        kl_texts=4,
        edit_gamma=0.9,
        edit_factors="target",
        replay=20,
        check_earlier=500,
    )
