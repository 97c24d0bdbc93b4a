"""The one config tree (minisgl/settings.py and its sections): a setting declared once is a serve
flag, a TOML key and an LLM keyword; each check is written once and says the same everywhere."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List

import pytest

import minisgl.llm
import minisgl.server.args
from minisgl import LLM
from minisgl.engine import EngineConfig
from minisgl.scheduler.config import SchedulerConfig
from minisgl.server.args import (SERVER_PREFILL_TOKENS, ServerConfig, _parser, load_file,
                                 parse_args)
from minisgl.settings import add_flags, build, from_namespace, names, section, setting, values


# --- a section that gains a field, defined here ---------------------------------------------------
@dataclass(frozen=True)
class DraftEngine(EngineConfig):
    draft_tokens: int = setting(0, "speculative tokens proposed per decode step")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.draft_tokens < 0:
            raise ValueError(f"draft_tokens must be >= 0, got {self.draft_tokens}")


@dataclass(frozen=True)
class DraftScheduler(SchedulerConfig):
    engine: EngineConfig = section(DraftEngine)


@dataclass(frozen=True)
class DraftServer(ServerConfig):
    scheduler: SchedulerConfig = section(
        lambda: DraftScheduler(max_prefill_tokens=SERVER_PREFILL_TOKENS))


@pytest.fixture
def draft_tree(monkeypatch: pytest.MonkeyPatch) -> None:
    """The server and the offline API built over the tree with the new field."""
    monkeypatch.setattr(minisgl.server.args, "ServerConfig", DraftServer)
    monkeypatch.setattr(minisgl.llm, "SchedulerConfig", DraftScheduler)


def test_a_new_field_is_a_flag_a_file_key_and_a_keyword(draft_tree: None,
                                                        tmp_path: Path) -> None:
    assert "--draft-tokens" in _parser(DraftServer()).format_help()
    assert parse_args([]).engine.draft_tokens == 0  # type: ignore[attr-defined]
    assert parse_args(["--draft-tokens", "3"]).engine.draft_tokens == 3  # type: ignore[attr-defined]
    f = tmp_path / "c.toml"
    f.write_text("draft-tokens = 2\n")
    assert load_file(f) == {"draft_tokens": 2}
    assert parse_args(["--config", str(f)]).engine.draft_tokens == 2  # type: ignore[attr-defined]
    f.write_text('draft_tokens = "two"\n')
    with pytest.raises(ValueError, match="draft_tokens must be of type int, got 'two'"):
        parse_args(["--config", str(f)])
    assert "draft_tokens" in names(DraftScheduler())  # the keywords LLM takes
    assert build(DraftScheduler(), {"draft_tokens": 4}, "LLM()").engine.draft_tokens == 4
    # The offline API takes the keyword and its check judges it, before any model is loaded.
    with pytest.raises(ValueError, match="draft_tokens must be >= 0, got -1"):
        LLM(None, draft_tokens=-1)
    with pytest.raises(ValueError, match="draft_tokens must be >= 0, got -1"):
        parse_args(["--draft-tokens", "-1"])


# --- each check once: the same message from every path --------------------------------------------
def _toml(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return f'"{value}"' if isinstance(value, str) else str(value)


def _messages(settings: Dict[str, object], tmp_path: Path) -> List[str]:
    """The ValueError message of `settings` from the command line, a TOML file, LLM keywords and
    the sections' constructors."""
    argv: List[str] = []
    for name, value in settings.items():
        flag = "--" + name.replace("_", "-")
        if value is False:
            argv.append("--no-" + flag[2:])
        else:
            argv += [flag, str(value)]
    f = tmp_path / "c.toml"
    f.write_text("".join(f"{k.replace('_', '-')} = {_toml(v)}\n" for k, v in settings.items()))
    out = []
    for attempt in (lambda: parse_args(argv), lambda: parse_args(["--config", str(f)]),
                    lambda: LLM(None, **settings),  # fails before any model is loaded
                    lambda: build(SchedulerConfig(), settings, "test")):
        with pytest.raises(ValueError) as e:
            attempt()
        out.append(str(e.value))
    return out


@pytest.mark.parametrize("settings,message", [
    ({"cuda_graph_max_bs": -1}, "cuda_graph_max_bs must be >= 0 (0: no graphs), got -1"),
    ({"page_size": 0}, "page_size must be >= 1, got 0"),
    ({"tp": 0}, "tp must be >= 1, got 0"),
    ({"mem_fraction": 1.5}, "mem_fraction must be in (0, 1), got 1.5"),
    ({"max_kv_tokens": 0}, "max_kv_tokens must be >= 1, got 0"),
    ({"max_prefill_tokens": 0}, "max_prefill_tokens must be >= 1, got 0"),
    ({"decode_reserve_tokens": -1}, "decode_reserve_tokens must be >= 0, got -1"),
    ({"allreduce": "symm-fused", "fused_ops": False}, "allreduce 'symm-fused' fuses"),
    ({"pdl": "on", "device": "cpu"}, "pdl 'on' needs device 'cuda' and fused_ops"),
    ({"allreduce": "symm", "device": "cpu"}, "allreduce 'symm' needs CUDA"),
])
def test_a_bad_value_says_the_same_everywhere(settings: Dict[str, object], message: str,
                                              tmp_path: Path) -> None:
    cli, toml, llm, tree = _messages(settings, tmp_path)
    assert cli == toml == llm == tree and cli.startswith(message), (cli, toml, llm, tree)


def test_a_choice_is_refused_alike_by_file_and_keyword(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text('cache = "lru"\n')
    with pytest.raises(ValueError) as by_file:
        parse_args(["--config", str(f)])
    with pytest.raises(ValueError) as by_keyword:
        LLM(None, cache="lru")
    assert str(by_file.value) == str(by_keyword.value) == "cache must be radix or naive, got 'lru'"
    with pytest.raises(SystemExit):  # argparse knows the choices too
        parse_args(["--cache", "lru"])


def test_unknown_keyword_or_key_is_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="LLM\\(\\): unknown setting 'max_batch'"):
        LLM(None, max_batch=4)
    with pytest.raises(ValueError, match="max_kv_tokens must be of type int, got 'many'"):
        LLM(None, max_kv_tokens="many")
    f = tmp_path / "c.toml"
    f.write_text("max-batch = 4\n")
    with pytest.raises(ValueError, match="unknown setting 'max-batch'"):
        parse_args(["--config", str(f)])


def test_a_json_setting_takes_a_table_or_a_dict_as_its_text(tmp_path: Path) -> None:
    """A JSON object's setting (`setting(json_value=True)`) from a TOML table, an `LLM()`
    dict (vLLM's form) or the flag's text is one value; another str setting refuses a table."""
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    f = tmp_path / "c.toml"
    f.write_text('speculative_config = {method = "ngram", num_speculative_tokens = 3}\n'
                 "[hf_overrides]\nis_matryoshka = true\n")
    by_file = parse_args(["--config", str(f)])
    by_keyword = build(SchedulerConfig(), {"speculative_config": spec,
                                           "hf_overrides": {"is_matryoshka": True}}, "LLM()")
    by_flag = parse_args(["--speculative-config", '{"method": "ngram", '
                          '"num_speculative_tokens": 3}'])
    assert by_file.scheduler.speculative == by_keyword.speculative \
        == by_flag.scheduler.speculative is not None
    assert by_file.scheduler.engine.hf_overrides == by_keyword.engine.hf_overrides \
        == '{"is_matryoshka": true}'
    f.write_text('model = {path = "x"}\n')
    with pytest.raises(ValueError, match="model must be of type str"):
        parse_args(["--config", str(f)])


# --- the tree's shape -----------------------------------------------------------------------------
def test_every_setting_is_a_flag_with_help() -> None:
    text = _parser(ServerConfig()).format_help()
    for name in names(ServerConfig()):
        flag = "--" + name.replace("_", "-")
        assert flag in text or "--no-" + flag[2:] in text, name
    for flag in ("--disable-overlap", "--shell", "--max-n", "--log-level", "--served-model-name",
                 "--pdl", "--config", "--no-fused-ops", "--tune-gemms"):
        assert flag in text


def test_llm_keywords_keep_their_defaults() -> None:
    """Every keyword LLM took before the tree, with the same default (max_prefill_tokens None:
    the offline default for the device)."""
    cfg = values(SchedulerConfig())
    old = {"device": "auto", "dtype": None, "tp": 1, "page_size": 16, "max_prefill_tokens": None,
           "max_running_requests": 256, "max_kv_tokens": None, "cache": "radix",
           "load_format": "auto", "seed": 0, "attention_backend": "auto",
           "check_lockstep": False, "overlap": None, "decode_reserve_tokens": None,
           "cuda_graph_max_bs": 256, "allreduce": "auto", "fused_ops": True, "pdl": "auto",
           "tune_gemms": False}
    assert {k: cfg[k] for k in old} == old


def test_server_and_offline_prefill_defaults_differ_in_one_place() -> None:
    assert SchedulerConfig().max_prefill_tokens is None
    assert parse_args([]).scheduler.max_prefill_tokens == SERVER_PREFILL_TOKENS == 8192


def test_overlap_flags_and_the_disable_overlap_key(tmp_path: Path) -> None:
    assert parse_args([]).scheduler.overlap is None
    assert parse_args(["--disable-overlap"]).scheduler.overlap is False
    assert parse_args(["--no-overlap"]).scheduler.overlap is False
    assert parse_args(["--overlap"]).scheduler.overlap is True
    f = tmp_path / "c.toml"
    f.write_text("disable-overlap = true\n")
    assert parse_args(["--config", str(f)]).scheduler.overlap is False
    f.write_text("disable-overlap = false\n")
    assert parse_args(["--config", str(f)]).scheduler.overlap is None
    f.write_text("overlap = true\n")
    assert parse_args(["--config", str(f), "--disable-overlap"]).scheduler.overlap is False


def test_mixed_steps_resolve_by_device_and_size_the_engine_graphs() -> None:
    """Unset: on with CUDA and prefill graphs, else off; the engine's mixed graphs carry
    mixed_graph_rows decode rows where steps mix, none where they do not."""
    assert parse_args([]).scheduler.mixed_steps is None
    assert parse_args(["--no-mixed-steps"]).scheduler.mixed_steps is False
    on = parse_args(["--mixed-steps", "--mixed-graph-rows", "24"]).scheduler
    assert on.mixed and on.mixed_rows == 24
    cpu = SchedulerConfig(EngineConfig(device="cpu"))
    assert not cpu.mixed and cpu.mixed_rows == 0
    cuda = SchedulerConfig(EngineConfig(device="cuda"))
    assert cuda.mixed and cuda.mixed_rows == 64
    assert not SchedulerConfig(EngineConfig(device="cuda", prefill_graph_tokens=0)).mixed
    assert SchedulerConfig(EngineConfig(device="cuda"), mixed_steps=False).mixed_rows == 0
    with pytest.raises(ValueError, match="mixed_graph_rows must be >= 0, got -1"):
        SchedulerConfig(mixed_graph_rows=-1)


def test_bench_flags_come_from_the_tree() -> None:
    """A script's flags over a tree of its own defaults: every setting, with real defaults."""
    p = argparse.ArgumentParser()
    add_flags(p, SchedulerConfig(engine=EngineConfig(load_format="dummy")), skip=("seed",))
    ns = p.parse_args(["--pdl", "off", "--no-fused-ops", "--disable-overlap"])
    given = from_namespace(ns, SchedulerConfig())
    assert "seed" not in given and given["load_format"] == "dummy"
    assert (given["pdl"], given["fused_ops"], given["overlap"]) == ("off", False, False)
    assert build(SchedulerConfig(), given, "test").engine.pdl == "off"


def test_rank_config_resolves_the_device_and_fills_the_runtime_values() -> None:
    cfg = parse_args(["--device", "auto", "--tp", "2"])
    assert cfg.engine.device == "auto"
    rank = cfg.scheduler_config(Path("/m"), 1, "tcp://127.0.0.1:9", "a", "b", "c")
    assert rank.engine.device in ("cpu", "cuda") and rank.engine.model_path == "/m"
    assert (rank.engine.tp_info.rank, rank.engine.tp_info.size) == (1, 2)
    assert rank.engine.dist_init_method == "tcp://127.0.0.1:9" and not rank.engine.show_progress
    assert values(rank) == {**values(cfg.scheduler), "device": rank.engine.device}



def test_stream_interval_is_a_positive_count() -> None:
    """--stream-interval (vLLM's and SGLang's) paces streams; 0 would send nothing."""
    assert parse_args(["--stream-interval", "8"]).stream_interval == 8
    with pytest.raises(ValueError, match="stream_interval must be >= 1, got 0"):
        parse_args(["--stream-interval", "0"])
