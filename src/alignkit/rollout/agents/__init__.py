"""Multi-turn agents: environments (a registry, like the scorers'), tools as typed Python functions, tool-call
parsers, token-in-token-out rendering of the environment's messages, and the batched trajectory rollout the
``grpo_agent`` algorithm drives (``docs/workflows/agents.md``)."""
