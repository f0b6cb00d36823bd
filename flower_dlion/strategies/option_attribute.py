"""The strategy's options by their argument names, read-only: ``strategy.lr`` is ``strategy.options.step.lr``."""

from __future__ import annotations

from typing import Any

__all__ = ["OptionAttribute"]


class OptionAttribute:
    """A read-only attribute of the strategy: the field of the same name in one group of its ``options``.

    ``lr = OptionAttribute("step")`` in a class body makes ``obj.lr`` read ``obj.options.step.lr``;
    setting it raises ``AttributeError`` (the options are checked together: build a new strategy).

    Parameters
    ----------
    group : str
        The :class:`Options` field that holds the option.

    """

    def __init__(self, group: str) -> None:
        self.group = group
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        if self.name and self.name != name:
            raise TypeError(f"one OptionAttribute cannot be both {self.name} and {name}")
        self.name = name

    def __get__(self, obj: Any, objtype: type | None = None) -> Any:
        if obj is None:
            return self
        return getattr(getattr(obj.options, self.group), self.name)

    def __set__(self, obj: Any, value: Any) -> None:
        raise AttributeError(f"{self.name} is read-only (options.{self.group}.{self.name}): build a new strategy")
