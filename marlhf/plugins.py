"""One seam for every extension point of PPO: termination rules, advantage estimators, policy losses and rollout
engines, each kind a package (marlhf.termination, marlhf.estimators, marlhf.policy_losses, marlhf.engines) with its
registry in `base.py` and one file per built-in.

Each kind has a `Registry`. A plug-in is registered under a name with its traits (what the trainer must know
about it, such as whether an estimator needs a critic) and, optionally, its own options as a small dataclass:

    @dataclasses.dataclass
    class SentenceOptions:
        sentences: int = 1  # sentences per macro action

    @register_termination("sentences", options=SentenceOptions, reads_reference=False)
    def sentences(batch):
        ...  # batch.options.sentences; the batch holds what a rule may read, never the run's config

It is chosen by its name, or by its dotted path `package.module:object` (importing the module registers it; an
object that was never registered is a plug-in without options), with its options in a block:

    marlhf ppo --termination my_pkg.rules:sentences --termination_options '{sentences: 2}'
    termination: {name: my_pkg.rules:sentences, sentences: 2}          # in a YAML config

A plug-in's options dataclass is the one home of its options (declare each with marlhf.config.option: default,
help, bounds; a rule between them in its `__post_init__`), and where they are read (`config.plugin_options(kind)`).
The options of marlhf's own plug-ins are also PPOConfig's flat input aliases, generated from their dataclasses
(`--ngram 5` is `termination: {name: fixed, ngram: 5}`: marlhf.trainers.ppo_config.FLAT_OPTIONS), so every earlier
config and command keeps working. An option the chosen plug-in does not declare is an error that names the plug-in
and the option.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable, Mapping
from typing import Any

from marlhf.config import check_bounds, coerce_option
from marlhf.errors import did_you_mean
from marlhf.imports import import_function

__all__ = ["Plugin", "Registry"]


@dataclasses.dataclass(frozen=True)
class Plugin:
    """A registered plug-in: its kind and name, the object itself (a function, or an engine's factory), the
    dataclass of its options (None: it takes none) and its traits, also readable as attributes
    (`plugin.needs_critic`)."""

    kind: str
    name: str
    obj: Any
    options: type | None = None
    traits: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __getattr__(self, name: str) -> Any:
        traits = self.__dict__.get("traits", {})
        if name in traits:
            return traits[name]
        raise AttributeError(f"{self.kind} plug-in {self.__dict__.get('name')!r} has no trait {name!r}")

    @property
    def option_names(self) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(self.options)) if self.options is not None else ()

    def make_options(self, values: Mapping[str, Any]) -> Any:
        """The plug-in's options from `values` (None when it declares none); a key it does not declare is a
        ValueError naming the plug-in and the key."""
        unknown = sorted(set(values) - set(self.option_names))
        if unknown:
            declared = ", ".join(self.option_names) or "none"
            raise ValueError(f"{self.kind} {self.name!r} has no option {unknown[0]!r}"
                             f"{did_you_mean(unknown[0], self.option_names)}; its options: {declared}")
        if self.options is None:
            return None
        hints = typing.get_type_hints(self.options)
        fields = {f.name: f for f in dataclasses.fields(self.options)}
        checked = {}
        for key, value in values.items():  # a field declared with marlhf.config.option has its bounds checked
            label = f"{self.kind} {self.name!r} option {key!r}"
            checked[key] = coerce_option(label, value, hints[key])
            check_bounds(label, checked[key], fields[key].metadata.get("bounds", {}))
        return self.options(**checked)

    def describe(self) -> str:
        """`name (option=default, ...)`, for --help."""
        if self.options is None:
            return self.name
        defaults = ", ".join(f"{f.name}={f.default!r}" for f in dataclasses.fields(self.options))
        return f"{self.name} ({defaults})"


class Registry:
    """The plug-ins of one kind, by name; `default_traits` are what a plug-in registered without them has (and
    an unregistered dotted-path object)."""

    def __init__(self, kind: str, option: str, **default_traits: Any) -> None:
        self.kind = kind  # e.g. "termination rule"
        self.option = option  # the PPOConfig option that names one, e.g. "termination"
        self.default_traits = default_traits
        self.plugins: dict[str, Plugin] = {}

    def register(self, name: str, *, options: type | None = None, **traits: Any) -> Callable[[Any], Any]:
        """Decorator: register the object under `name` (an error if another object has the name)."""
        if not name or ":" in name:
            raise ValueError(f"a {self.kind}'s name must be non-empty and without ':', got {name!r}")
        unknown = sorted(set(traits) - set(self.default_traits))
        if unknown:
            raise TypeError(f"a {self.kind} has no trait {unknown[0]!r}; its traits: {sorted(self.default_traits)}")
        if options is not None and not dataclasses.is_dataclass(options):
            raise TypeError(f"a {self.kind}'s options must be a dataclass, got {options!r}")

        def decorate(obj: Any) -> Any:
            if name in self.plugins and self.plugins[name].obj is not obj:
                raise ValueError(f"a {self.kind} named {name!r} is already registered")
            self.plugins[name] = Plugin(self.kind, name, obj, options, {**self.default_traits, **traits})
            return obj

        return decorate

    def get(self, spec: str) -> Plugin:
        """The plug-in registered as `spec`, or the object at the dotted path `package.module:object`."""
        if spec in self.plugins:
            return self.plugins[spec]
        if ":" not in spec:
            raise ValueError(f"{self.option} must be one of {sorted(self.plugins)} or a dotted path "
                             f"'package.module:object', got {spec!r}{did_you_mean(spec, self.plugins)}")
        obj = import_function(spec, self.option)
        registered = next((p for p in self.plugins.values() if p.obj is obj), None)
        return registered or Plugin(self.kind, spec, obj, None, dict(self.default_traits))

    def __contains__(self, name: str) -> bool:
        return name in self.plugins

    def names(self) -> list[str]:
        return sorted(self.plugins)
