"""--draft suffix / suffix+DIR / suffix+model (with --model) on the command line, down to the EngineConfig."""

import pytest

from minedraft.cli.common import _engine_kw
from minedraft.cli.main import build_parser
from minedraft.config import DEFAULT_DRAFT


def kw(*argv):
    return _engine_kw(build_parser().parse_args(["generate", "x", *argv]))


def test_draft_strings_reach_the_config():
    assert kw("--draft", "suffix")["draft"] == "suffix"
    assert kw("--draft", f"suffix+{DEFAULT_DRAFT}", "--hybrid-threshold", "2.5") | {} == {
        **kw(), "draft": f"suffix+{DEFAULT_DRAFT}", "hybrid_threshold": 2.5}
    from minedraft.models.hub import resolve_model
    target, draft = resolve_model("tiny")
    tiny = kw("--model", "tiny", "--draft", "suffix")
    assert tiny["draft"] == "suffix" and tiny["target"] == target
    assert kw("--model", "tiny", "--draft", "suffix+model")["draft"] == f"suffix+{draft}"
    assert kw("--model", "tiny")["draft"] == draft  # a named pair keeps its own draft otherwise


def test_bad_suffix_draft_is_one_line_error(capsys):
    from minedraft.cli.main import main
    assert main(["generate", "x", "--draft", "suffix+/nowhere"]) == 2
    assert "not a directory" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "x", "--hybrid-threshold", "abc"])


def test_k_defaults_by_draft_on_the_command_line_and_in_the_config():
    """No --k: 6 for suffix drafts alone (the setting the suffix tables measured), 4 with a draft model (the hybrid
    included); a given k stands, and generate's cache sizing uses the resolved one."""
    from minedraft.cli.main import _generate_config
    from minedraft.config import EngineConfig, default_k
    assert EngineConfig.k is None and kw("--draft", "suffix")["k"] is None
    assert EngineConfig(draft="suffix").k == 6 == default_k("suffix")
    assert EngineConfig().k == 4 == EngineConfig(draft=f"suffix+{DEFAULT_DRAFT}").k
    assert EngineConfig(draft="suffix", k=3).k == 3
    cfg = _generate_config(build_parser().parse_args(["generate", "x", "--draft", "suffix", "--max-tokens", "10"]))
    assert cfg.k == 6 and cfg.kv_cache_tokens >= cfg.max_prompt_tokens + 10 + 6 + 1
    with pytest.raises(ValueError, match="--k must be in 1..16"):
        _generate_config(build_parser().parse_args(["generate", "x", "--k", "0"]))
