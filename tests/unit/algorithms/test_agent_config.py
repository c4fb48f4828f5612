"""The ``agent:`` section (issue 48): names are checked at load with the closest valid one, and an environment from
a one-file plugin (tests/plugins/agent_env.py, the docs' example) is found through ``plugins:`` and steps."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from alignkit.algorithms import ALGORITHMS
from alignkit.algorithms.agent import AgentConfig
from alignkit.config import load_config
from alignkit.errors import UnknownNameError
from alignkit.rollout.agents.env import ENVIRONMENTS, EnvState

RECIPE = Path(__file__).resolve().parents[3] / "configs" / "grpo_agent_calculator.yaml"


def test_unknown_names_fail_at_load() -> None:
    with pytest.raises(UnknownNameError, match="did you mean 'calculator'"):
        load_config(RECIPE, ["agent.env=calculater"], notes=False)
    with pytest.raises(UnknownNameError, match="tool-call parser"):
        load_config(RECIPE, ["agent.tool_call_parser=qwen"], notes=False)


def test_plugin_environment() -> None:
    cfg = load_config(RECIPE, ["plugins=[tests.plugins.agent_env]", "agent.env=reverse_word", "agent.credit=turn"],
                      notes=False)
    a = cfg.section(AgentConfig)
    assert (a.env, a.credit, a.max_turns, a.max_total_tokens) == ("reverse_word", "turn", 3, 112)
    env = ENVIRONMENTS.get("reverse_word")(tool_timeout_s=a.tool_timeout_s)
    state = EnvState({"prompt": "Reverse: cat", "answer": "tac"}, [])
    r = env.step(state, '<tool_call>{"name": "reverse", "arguments": {"text": "cat"}}</tool_call>')
    assert r.messages == [{"role": "tool", "content": "tac"}] and not r.done
    assert env.step(state, "tac").reward == 1.0


def test_auto_aggregation_is_token_mean(micro_model: Path) -> None:
    """``sequence_mean`` would divide each trajectory's loss by the environment's ids too: auto is token_mean."""
    tok = AutoTokenizer.from_pretrained(micro_model)
    for extra, want in (([], "token_mean"), (["agent.estimator=dr_grpo"], "constant"),
                        (["grpo.loss_aggregation=sequence_mean"], "sequence_mean")):
        cfg = load_config(RECIPE, [f"model.name_or_path={micro_model}", "grpo.loss_aggregation=auto", *extra],
                          notes=False)
        assert ALGORITHMS.get("grpo_agent")(cfg, tok).group.aggregation == want, extra


def test_env_args_reach_the_environment(micro_model: Path) -> None:
    """``agent.env_args`` are the environment's settings: ``{tool: calc}`` offers the short ``calc(x)`` call; an
    unknown setting or tool is refused with the key named (issue 48, B)."""
    from alignkit.errors import ConfigError

    tok = AutoTokenizer.from_pretrained(micro_model)
    base = [f"model.name_or_path={micro_model}"]
    algo = ALGORITHMS.get("grpo_agent")(load_config(RECIPE, base, notes=False), tok)  # the recipe's {tool: calc}
    assert [s["function"]["name"] for s in algo.env.schemas()] == ["calc"]
    state = EnvState({"prompt": "What is 34*82?", "answer": "2788"}, [])
    r = algo.env.step(state, '<tool_call>{"name":"calc","arguments":{"x":"34*82"}}</tool_call>')
    assert r.messages == [{"role": "tool", "content": "2788"}] and state.counts == {"ok": 1}
    default = ALGORITHMS.get("grpo_agent")(load_config(RECIPE, [*base, "agent.env_args={}"], notes=False), tok)
    assert [s["function"]["name"] for s in default.env.schemas()] == ["calculator"]
    for bad, match in (("{tool: abacus}", r"agent\.env_args\.tool: expected one of \['calc', 'calculator'\]"),
                       ("{digits: 2}", r"agent\.env_args: unknown key\(s\) \['digits'\]")):
        with pytest.raises(ConfigError, match=match):
            ALGORITHMS.get("grpo_agent")(load_config(RECIPE, [*base, f"agent.env_args={bad}"], notes=False), tok)


def test_plugin_with_a_syntax_error_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``plugins:`` file that does not parse names its file and line (it was a SyntaxError traceback)."""
    from alignkit.errors import ConfigError

    (tmp_path / "broken_env_plugin.py").write_text("import os\ndef f(:\n    pass\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match=r"plugins: 'broken_env_plugin': .*broken_env_plugin\.py:2: invalid syntax"):
        load_config(RECIPE, ["plugins=[broken_env_plugin]"], notes=False)


def test_a_row_without_the_environments_field_is_refused_when_read(micro_model: Path, tmp_path: Path) -> None:
    """The calculator environment reads ``row["answer"]`` (``row_fields``): a row without it is one line naming the
    file and row as the data set is read, before any rollout (it was a KeyError mid-rollout)."""
    from alignkit.errors import DataError

    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "What is 2*3?", "answer": "6"}\n{"prompt": "What is 4*5?"}\n')
    for name in ("grpo_agent", "ppo_agent"):
        cfg = load_config(RECIPE, [f"model.name_or_path={micro_model}", f"algorithm={name}"], notes=False)
        algo = ALGORITHMS.get(name)(cfg, AutoTokenizer.from_pretrained(micro_model))
        with pytest.raises(DataError, match=r"rows\.jsonl:2: missing field 'answer'"):
            algo.data.build_dataset([str(rows)], "train")


def test_a_plugin_that_raises_or_registers_a_taken_name_is_one_line(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A plugin that registers an environment name already taken, or raises while imported, is one line naming its
    own file and line and the exception (they were tracebacks)."""
    from alignkit.errors import ConfigError

    (tmp_path / "taken_env_plugin.py").write_text(
        "from alignkit.rollout.agents.env import ToolEnvironment, register_environment\n\n\n"
        "@register_environment('calculator')\nclass Mine(ToolEnvironment):\n    pass\n")
    (tmp_path / "raising_env_plugin.py").write_text("import os\nx = 1 / 0\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name, want in (("taken_env_plugin", r"py:4: ValueError: environment 'calculator' is registered twice"),
                       ("raising_env_plugin", r"py:2: ZeroDivisionError: division by zero")):
        with pytest.raises(ConfigError, match=rf"plugins: importing '{name}' failed at .*{name}\.{want}"):
            load_config(RECIPE, [f"plugins=[{name}]"], notes=False)


def test_a_trajectory_budget_below_one_turn_is_refused_at_load() -> None:
    """``agent.max_total_tokens`` below ``rollout.max_new_tokens`` cut the first turn at the trajectory's budget
    silently; now one line at load naming both keys (grpo_agent and ppo_agent), equal passes."""
    from alignkit.errors import ConfigError

    for algorithm in ("grpo_agent", "ppo_agent"):
        with pytest.raises(ConfigError, match=r"agent.max_total_tokens \(40\) is below rollout.max_new_tokens \(56\)"):
            load_config(RECIPE, [f"algorithm={algorithm}", "agent.max_total_tokens=40"], notes=False)
        load_config(RECIPE, [f"algorithm={algorithm}", "agent.max_total_tokens=56"], notes=False)
