"""Per-algorithm config sections: each algorithm file defines its section's dataclass and registers
it here under the YAML key users write (``dpo:``, ``reward:``, ``sft:`` ...), so a new algorithm adds
a section without touching the central schema.

A registered section is read from the top level of the YAML like the core sections, checked by the
same typed conversion (ranges, choices, unknown keys with a close match), and its own cross-field
checks run in the dataclass's ``__post_init__`` (raise :class:`~alignkit.errors.ConfigError` naming
the dotted key). ``RunConfig`` exposes each one as an attribute (``cfg.dpo.beta``); an absent section
holds its defaults.
"""

from __future__ import annotations

from typing import Any

from alignkit.registry import Registry

SECTIONS: Registry[type] = Registry("config section")


def register_section(name: str) -> Any:
    """Class decorator: ``@register_section("dpo")`` on the section's dataclass."""
    return SECTIONS.register(name)


def load_sections() -> None:
    """Import the algorithm modules, which register their sections (and themselves)."""
    import alignkit.algorithms  # noqa: F401  (import for its registrations)
