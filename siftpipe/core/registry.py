"""A small name -> factory registry, shared by scorers and policies."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

from ..errors import RegistryError

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")


class Registry(Generic[T]):
    """Maps names to factories; re-registering a name is an error unless ``overwrite=True``."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._factories: dict[str, Callable[..., T]] = {}

    def register(self, name: str, *, overwrite: bool = False) -> Callable[[F], F]:
        if not isinstance(name, str) or not name:
            raise RegistryError(f"a {self.kind} name must be a non-empty string, got {name!r}")

        def decorator(factory: F) -> F:
            if name in self._factories and not overwrite and self._factories[name] is not factory:
                raise RegistryError(
                    f"{self.kind} {name!r} is already registered (to {self._factories[name]!r}); "
                    f"pick another name or pass overwrite=True"
                )
            self._factories[name] = factory
            return factory

        return decorator

    def get(self, name: str, **kwargs: Any) -> T:
        try:
            factory = self._factories[name]
        except KeyError:
            raise RegistryError(
                f"unknown {self.kind} {name!r}; registered: {', '.join(sorted(self._factories))}. "
                f"Register yours with siftpipe.register_{self.kind}({name!r})"
            ) from None
        return factory(**kwargs)

    def names(self) -> list[str]:
        return sorted(self._factories)
