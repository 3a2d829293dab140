"""The one rule for mistakes on the command line, shared by every entry point (launch/*.py, python -m marl_jax.*).

An unknown flag or ``--config.<key>``, a value of the wrong type or out of its range, a missing required flag, a
config file that does not load, and whatever a tool's ``main`` raises as ``app.UsageError`` (``validate()``'s
errors among them) end with one line on stderr, ``<tool>: <what is wrong>; <the fix>``, and exit status 2, without
a traceback (MARL_JAX_TRACEBACK=1 shows it):

    run.py: unknown config key 'polcy' (--config.polcy): did you mean --config.policy? ...

``run(main, prog)`` stands in for ``absl.app.run(main)``; argparse tools use ``ArgumentParser``. ``run`` also sets
absl's logging to WARNING (unless ``--verbosity``, ``-v`` or ``--logger_levels`` is given): absl's default, INFO,
passes on JAX's backend probing ("Unable to initialize backend ...") and other libraries' chatter.
"""
from __future__ import annotations

import argparse
import difflib
import os
import re
import sys
from typing import Any, Callable, NoReturn, Sequence

USAGE_ERROR = 2  # the exit status of a command-line mistake (as argparse's)
TRACEBACK_ENV = "MARL_JAX_TRACEBACK"


def one_line(message: Any) -> str:
    """`message` on one line: a quoted traceback shrinks to its last line (the error itself), lines ending in ':'
    run on into the next, other lines are joined with '; '."""
    text = str(message).strip()
    if "Traceback (most recent call last)" in text:  # config_flags quotes a config file's traceback
        head = text.split("Traceback (most recent call last)")[0].strip()
        head = re.sub(r"\s*Error whilst parsing config file:\s*$", "", head)
        last = [line for line in text.splitlines() if line.strip()][-1].strip()
        last = re.sub(r"^(\w+\.)*\w*(Error|Exception): ", "", last)
        text = f"{head} {last}" if head else last
    out = ""
    for line in (ln.strip() for ln in text.splitlines()):
        if line:
            out += line if not out else (" " if out.endswith(":") else "; ") + line
    return out


def fail(prog: str, message: Any) -> NoReturn:
    """Print `<prog>: <message>` as one line on stderr and exit with status 2."""
    sys.stdout.flush()
    sys.stderr.write(f"{prog}: {one_line(message)}\n")
    sys.stderr.flush()
    sys.exit(USAGE_ERROR)


# ---- absl flags ----

def _config_flags(flag_values) -> dict[str, Any]:
    """{name: flag} of the ml_collections config flags (--config, --matrix) defined in `flag_values`."""
    from ml_collections.config_flags import config_flags  # the module: is_config_flag is not re-exported

    return {name: f for name, f in flag_values._flags().items()  # pylint: disable=protected-access
            if name == f.name and config_flags.is_config_flag(f)}


def _argv_pairs(argv: Sequence[str]) -> list[tuple[str, str | None]]:
    """(name, value) of the flags in argv; value None for a bare --name (a bool, or a value in the next word)."""
    out, args = [], list(argv[1:])
    for i, a in enumerate(args):
        if a == "--":
            break
        m = re.match(r"^--?([\w.-]+)(?:=(.*))?$", a, re.S)
        if m:
            value = m.group(2)
            if value is None and i + 1 < len(args) and not args[i + 1].startswith("-"):
                value = args[i + 1]
            out.append((m.group(1), value))
    return out


def _is_error_config(config: Any) -> bool:
    return type(config).__name__ == "_ErrorConfig"  # config_flags' stand-in for a config file that did not load


def _load_config(flag, spec: str | None):
    """The config file's config before overrides (what `--<name>=<spec>` loads), or None."""
    if spec is None:
        value = getattr(flag, "value", None)
        return value if hasattr(value, "keys") or _is_error_config(value) else None
    try:
        return flag.parser.parse(spec)
    except Exception:  # pylint: disable=broad-except  # a config file that raises: the parse error says why
        return None


def _file_error(name: str, spec: str, config, help_text: str) -> str:
    path = spec.split(":", 1)[0]
    if not os.path.isfile(path):
        return (f"--{name}={spec}: no config file {path!r} (paths are relative to {os.getcwd()}); give the path of "
                f"one: --{name}={help_text}")
    err = getattr(config, "_error", None)
    return f"--{name}={spec}: the config file did not load: {err}"


def _keys(node) -> list[str] | None:
    return sorted(node.keys()) if hasattr(node, "keys") else None


def _type_name(value: Any) -> str:
    name = type(value).__name__
    return {"str": "a string", "int": "an integer", "float": "a float", "bool": "a bool (true or false)",
            "NoneType": "a value (None in the config file)", "tuple": "a tuple",
            "list": "a list"}.get(name, f"a {name}")


def _unknown_key(name: str, config, path: str, suggestion: tuple[str, str] | None) -> str | None:
    """The message for --<name>.<path> when a key on the path does not exist (None when every key does)."""
    node, seen = config, []
    parts = path.split(".")
    for i, part in enumerate(parts):
        where = "--" + ".".join([name] + seen)
        keys = _keys(node)
        if keys is None:
            return (f"{where} is {_type_name(node)}, not a group of keys, so it has no key {part!r}; set it with "
                    f"{where}=<value>")
        if part not in keys:
            close = suggestion[0] if suggestion and suggestion[1] == part else None
            close = close or next(iter(difflib.get_close_matches(part, keys, n=1)), None)
            rest = "".join("." + p for p in parts[i + 1:])
            listed = ", ".join(keys)
            if close:
                return (f"unknown config key {part!r} (--{name}.{path}): did you mean {where}.{close}{rest}? "
                        f"(keys of {where}: {listed})")
            return f"unknown config key {part!r} (--{name}.{path}): use one of the keys of {where}: {listed}"
        node, seen = node[part], seen + [part]
    return None


def _suggestion(exc: BaseException) -> tuple[str, str] | None:
    """(suggested, given) from ml_collections' 'Did you mean "policy" instead of "polcy"?', if in the error."""
    m = re.search(r'Did you mean "([^"]+)" instead of "([^"]+)"', str(exc).replace("\\n", "\n"))
    return (m.group(1), m.group(2)) if m else None


def _flag_help(flag) -> str:
    text = (flag.help or "").strip().rstrip(".")
    d = flag.default
    default = "" if d is None else f"; default {d!r}" if isinstance(d, str) else f"; default {d}"
    return f"--{flag.name}: {text}{default}" if text else f"--{flag.name}{default}"


def flag_error(exc: BaseException, argv: Sequence[str], flag_values=None) -> str:
    """One message, naming the flag or config key and the fix, for an error absl's parsing of `argv` raised."""
    from absl import flags

    fv = flags.FLAGS if flag_values is None else flag_values
    pairs = _argv_pairs(argv)
    cfg_flags = _config_flags(fv)
    configs = {}
    for name, flag in cfg_flags.items():
        spec = next((v for n, v in pairs if n == name), None)
        config = _load_config(flag, spec)
        if _is_error_config(config):  # a config file that is not there wins over what its overrides say
            return _file_error(name, spec or "", config, flag.help)
        configs[name] = (spec, config)

    def config_field(flag_name: str):  # (config flag name, path, config) of a --<config>.<path> flag
        for name, (_, config) in configs.items():
            for prefix in (name + ".", "no" + name + "."):
                if flag_name.startswith(prefix) and config is not None:
                    return name, flag_name[len(prefix):], config
        return None

    if isinstance(exc, flags.UnrecognizedFlagError):
        given = exc.flagname
        m = re.search(r"Did you mean: (.*?) \?", str(exc))  # absl's suggestions
        close = [c.strip() for c in m.group(1).split(",")] if m else []
        if "." in given and not close and cfg_flags:  # --confg.policy: the config flag's name misspelt
            head, rest = given.split(".", 1)
            close = [f"{c}.{rest}" for c in difflib.get_close_matches(head.removeprefix("no"), list(cfg_flags), n=1)]
        if close and given.startswith("no") and close[0] in fv and fv[close[0]].boolean:
            close[0] = "no" + close[0]  # --noprogres: --noprogress
        fix = f": did you mean --{close[0]}?" if close else ""
        return f"unknown flag --{given}{fix} (--helpshort lists the flags)"
    if isinstance(exc, flags.IllegalFlagValueError):
        text = str(exc)
        m = re.match(r"^flag --([\w.-]+)=", text)
        if not m:
            return one_line(text)
        fname = m.group(1)
        value = next((v for n, v in pairs if n == fname), None)
        parsed = fv[fname].value if fname in fv else None
        value = parsed if value is None else value
        detail = next((text[len(p):] for p in (f"flag --{fname}={value}: ", f"flag --{fname}={parsed}: ")
                       if text.startswith(p)), text[m.end():])
        if fname in fv and fv[fname].boolean and "Non-boolean argument" in detail:
            detail = f"--{fname} takes true or false (or --{fname} / --no{fname})"
        if re.match(rf"^Flag --{re.escape(fname)} must (have a value other than None|be (specified|set))", detail):
            help_text = (fv[fname].help or "").strip().rstrip(".") if fname in fv else ""
            return f"--{fname} is required" + (f" (--{fname}: {help_text})" if help_text else "")
        if fname in cfg_flags:  # the config file raised as it loaded
            return one_line(f"--{fname}={value}: {detail}")
        field = config_field(fname)
        if field is not None:
            name, path, config = field
            try:
                node = config
                for part in path.split("."):
                    node = node[part]
            except Exception:  # pylint: disable=broad-except
                return one_line(f"--{fname}={value}: {detail}")
            if _keys(node) is not None:
                first = _keys(node)[0] if _keys(node) else "<key>"
                return (f"--{fname}={value}: --{fname} is a group of keys ({', '.join(_keys(node))}), not a value: "
                        f"set one of them, e.g. --{name}.{path}.{first}={value}")
            return one_line(f"--{fname}={value}: {detail}; --{name}.{path} takes {_type_name(node)} "
                            f"(the config file's value: {node!r})")
        help_part = f" ({_flag_help(fv[fname])})" if fname in fv else ""
        return one_line(f"--{fname}={value}: {detail}{help_part}")
    if isinstance(exc, (KeyError, AttributeError, TypeError, ValueError, OSError)):
        suggestion = _suggestion(exc)
        for n, _ in pairs:
            field = config_field(n)
            if field is not None:
                message = _unknown_key(field[0], field[2], field[1], suggestion)
                if message:
                    return message
    if type(exc).__name__ == "FlagOrderError":  # config_flags: an override before its config file
        m = re.search(r"before a value for --([\w.-]+)", str(exc))
        name = m.group(1) if m else "<config>"
        return f"{one_line(exc)}: give --{name}=<file> first, then its --{name}.<key> overrides"
    if isinstance(exc, flags.Error):
        return f"{one_line(exc)} (--helpshort lists the flags)"
    while isinstance(exc, (KeyError, AttributeError)) and exc.args and isinstance(exc.args[0], BaseException):
        exc = exc.args[0]
    text = exc.args[0] if isinstance(exc, KeyError) and exc.args and isinstance(exc.args[0], str) else str(exc)
    return f"cannot apply the flags: {one_line(text)}"


def parse_flags(argv: list[str], prog: str, flag_values=None) -> list[str]:
    """absl's flag parsing, where a mistake ends the program with one line naming it and the fix (flag_error)."""
    from absl import flags

    fv = flags.FLAGS if flag_values is None else flag_values
    try:
        rest = fv(argv)
    except Exception as e:  # pylint: disable=broad-except
        if os.environ.get(TRACEBACK_ENV) or isinstance(e, BrokenPipeError):  # --helpfull | head: not a mistake
            raise
        try:
            message = flag_error(e, argv, fv)
        except Exception:  # pylint: disable=broad-except  # naming the key failed: absl's own words, still one line
            message = one_line(e)
        fail(prog, message)
    for name, flag in _config_flags(fv).items():  # a config file that did not load: say so before main uses it
        if _is_error_config(flag.value):
            spec = next((v for n, v in _argv_pairs(argv) if n == name), "") or ""
            fail(prog, _file_error(name, spec, flag.value, flag.help))
    return rest


def quiet_logging() -> None:
    """absl logging at WARNING unless the command line sets its level (--verbosity, -v, --logger_levels)."""
    from absl import flags, logging

    fv = flags.FLAGS
    if any(n in fv and fv[n].present for n in ("verbosity", "logger_levels")):
        return
    logging.set_verbosity(logging.WARNING)


def run(main: Callable[[list[str]], Any], prog: str | None = None, argv: Sequence[str] | None = None) -> None:
    """absl.app.run(main) under the rule above: flag mistakes and app.UsageError end in one line, exit status 2."""
    from absl import app

    prog = prog or os.path.basename(sys.argv[0])

    def main_(args):
        quiet_logging()
        try:
            return main(args)
        except app.UsageError as e:
            if os.environ.get(TRACEBACK_ENV):
                raise
            fail(prog, e)

    app.run(main_, argv=list(argv) if argv is not None else None, flags_parser=lambda a: parse_flags(a, prog))


# ---- argparse ----

class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser, whose mistakes end in one line (not the usage text and the error), exit status 2."""

    def error(self, message: str) -> NoReturn:
        fail(self.prog, f"{message} (--help lists the arguments)")
