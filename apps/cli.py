"""Command-line flags from an app's config dataclass: one `--flag` per field, same name."""

import argparse
import dataclasses
import typing


def parse_config(config_class, argv, *, prog, description, check=None, presets=None):
    """Parses `argv` into a `config_class` instance.

    `bool` fields become switches, `tuple` fields take one or more values of their
    default's element type, and `int | None` fields take an int, or `none` for None. `check(config)`
    may raise `ValueError`; it becomes an argparse error (usage and the message on
    stderr, exit status 2). `presets(args)` may return new defaults chosen by the
    parsed flags (a `--quick` mode, say); flags given explicitly still win.
    """
    defaults = config_class()
    parser = argparse.ArgumentParser(
        prog=prog, description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    for field in dataclasses.fields(config_class):
        default = getattr(defaults, field.name)
        if field.type is bool:
            parser.add_argument(f"--{field.name}", action="store_true")
        elif field.type is tuple:
            parser.add_argument(
                f"--{field.name}", type=type(default[0]), nargs="+", default=list(default)
            )
        else:
            # `int | None` -> int, and the word `none` -> None (a default that is set, unset)
            kind = next((t for t in typing.get_args(field.type) if t is not type(None)), field.type)
            if type(None) in typing.get_args(field.type):
                kind = _or_none(kind)
            parser.add_argument(f"--{field.name}", type=kind, default=default)
    args = parser.parse_args(argv)
    preset = presets(args) if presets else None
    if preset:
        parser.set_defaults(**preset)
        args = parser.parse_args(argv)
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in vars(args).items()}
    config = config_class(**values)
    if check is not None:
        try:
            check(config)
        except ValueError as error:
            parser.error(str(error))
    return config


def _or_none(kind):
    """An argparse `type`: the word `none` (any case) is None, anything else `kind(value)`."""

    def parse(value):
        return None if value.lower() == "none" else kind(value)

    parse.__name__ = kind.__name__  # argparse names it in "invalid int value: 'many'"
    return parse
