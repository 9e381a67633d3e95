"""What every fleetgate configuration file shares: TOML loading, the ``[redis]`` table, listen
addresses and errors that name the field.

The coordinator (``fleetgate.coordinator.config``) and the proxy (``fleetgate.proxy.config``)
each decode one TOML file into frozen msgspec structs. The parts they have in common live here:

* :func:`read_toml` / :func:`decode_toml`: a file (or text) to a mapping, every failure a
  :class:`~fleetgate.errors.ConfigError` naming the file;
* :func:`convert`: the mapping to the configuration's struct, a validation failure turned into one
  line naming the field (:func:`explain`): ``gates[2].floor: expected int >= 1, got 0``;
* :class:`RedisSettings`: the ``[redis]`` table (``url``, ``prefix``), filled from
  :data:`REDIS_ENV` as each file's docstring says;
* :func:`parse_listen`: ``host:port`` addresses;
* :func:`checked`: a validator's :class:`ConfigError` prefixed with the field it checked, which
  :func:`explain` then places under the table the field belongs to.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Final, TypeVar

import msgspec

from fleetgate._redis import validate_redis_url
from fleetgate.errors import ConfigError
from fleetgate.keys import validate_prefix

__all__ = [
    "DEFAULT_PREFIX",
    "DEFAULT_REDIS_URL",
    "REDIS_ENV",
    "RedisSettings",
    "checked",
    "convert",
    "decode_toml",
    "explain",
    "one_line",
    "parse_listen",
    "read_toml",
    "redis_from_env",
]

_T = TypeVar("_T")
_R = TypeVar("_R")
_S = TypeVar("_S", bound=msgspec.Struct)

#: The environment variables of the ``[redis]`` table: (variable, key).
REDIS_ENV: Final = (("FLEETGATE_REDIS_URL", "url"), ("FLEETGATE_PREFIX", "prefix"))
DEFAULT_REDIS_URL: Final = "redis://127.0.0.1:6379/0"
DEFAULT_PREFIX: Final = "fg"


def redis_from_env(
    url: str | None = None, prefix: str | None = None, env: Mapping[str, str] | None = None
) -> tuple[str, str]:
    """The Redis URL and key prefix: as given, else ``$FLEETGATE_REDIS_URL`` and
    ``$FLEETGATE_PREFIX``, else :data:`DEFAULT_REDIS_URL` and :data:`DEFAULT_PREFIX`."""
    env = os.environ if env is None else env
    return (
        url or env.get("FLEETGATE_REDIS_URL") or DEFAULT_REDIS_URL,
        prefix or env.get("FLEETGATE_PREFIX") or DEFAULT_PREFIX,
    )


def checked(field: str, validate: Callable[[_T], _R], value: _T) -> _R:
    """``validate(value)``, its :class:`ConfigError` re-raised as ``field: problem`` (the form
    :func:`explain` places under the table the field belongs to)."""
    try:
        return validate(value)
    except ConfigError as exc:
        raise ConfigError(f"{field}: {exc}") from None


def parse_listen(value: str, *, empty_host: bool = False) -> tuple[str, int]:
    """``host:port`` (IPv6 in brackets) -> ``(host, port)``; port 0 binds any free port.
    ``empty_host``: ``:port`` is accepted (every interface)."""
    host, sep, port = value.rpartition(":")
    if (
        not sep
        or not (host or empty_host)
        or not port.isascii()
        or not port.isdigit()
        or int(port) > 65535
    ):
        raise ConfigError(f"expected 'host:port' with a port 0-65535, got {value!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


class RedisSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Where the gates live: the Redis URL and the key prefix."""

    url: str = DEFAULT_REDIS_URL
    prefix: str = DEFAULT_PREFIX

    def __post_init__(self) -> None:
        # Scheme, port and query parameters (a TLS option misspelt is caught here, not at the
        # first command); messages never echo the password. See docs/security.md for TLS.
        checked("url", validate_redis_url, self.url)
        checked("prefix", validate_prefix, self.prefix)


def read_toml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The TOML file at ``path`` as a mapping; a missing, unreadable or invalid file is a
    :class:`ConfigError` naming it."""
    source = os.fspath(path)
    try:
        text = Path(path).read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"{source}: config file not found") from None
    except OSError as exc:
        raise ConfigError(f"{source}: cannot read config file: {exc.strerror}") from None
    return decode_toml(text, source)


def decode_toml(text: str | bytes, source: str = "<config>") -> dict[str, Any]:
    """TOML ``text`` as a mapping; invalid TOML is a :class:`ConfigError` naming ``source``."""
    try:
        raw: dict[str, Any] = msgspec.toml.decode(text)
    except msgspec.DecodeError as exc:
        raise ConfigError(one_line(f"{source}: invalid TOML: {exc}")) from None
    return raw  # a TOML document is always a table


def convert(
    cls: type[_S], data: dict[str, Any], *, injected: Mapping[str, str] | None = None
) -> _S:
    """``data`` validated as ``cls``; a failure is one :class:`ConfigError` line naming the
    field (:func:`explain`; ``injected``: fields written from environment variables)."""
    try:
        # str_keys: a TOML table's keys are strings; an int-keyed setting (band_share) takes
        # them as ints
        return msgspec.convert(data, type=cls, str_keys=True)
    except msgspec.ValidationError as exc:
        raise ConfigError(explain(str(exc), data, root=cls, injected=injected)) from None


# -------------------------------------------------------------------------------- error text

_AT = re.compile(r"^(?P<msg>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.DOTALL)
_STEP = re.compile(r"\.([^.\[]+)|\[(\d+)\]")
# A field, optionally subscripted by an index or a quoted key: floor, metrics_url[1],
# tenant_weights['a b{'] (a repr: quotes inside are escaped or of the other kind).
_FIELD_PREFIX = re.compile(
    r"^([A-Za-z_]\w*(?:\[(?:\d+|'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\")\])?): (.*)$", re.DOTALL
)
_FIELD_NAMED = re.compile(r"^Object (missing required|contains unknown) field `([^`]+)`$")
# msgspec's name of a decoded value's type (in "got `str`") -> the Python types it covers.
_GOT = re.compile(r", got `(\w+)`")
_KINDS: dict[str, tuple[type, ...]] = {
    "str": (str,),
    "bool": (bool,),
    "float": (float,),
    "array": (list, tuple),
    "object": (dict,),
    "null": (type(None),),
}


def explain(
    message: str,
    data: Any = None,
    *,
    root: type[msgspec.Struct] | None = None,
    injected: Mapping[str, str] | None = None,
) -> str:
    """msgspec's ``Expected `int` >= 1 - at `$.gates[2].floor``` as one readable line,
    ``gates[2].floor: expected int >= 1, got 0``.

    Our own ``field: problem`` (from a ``__post_init__``, see :func:`checked`) gets its table's
    path in front; an unknown field gets a "did you mean" from the fields of ``root`` at that
    path; the offending value is shown from ``data`` when the message does not say it; a field
    in ``injected`` (path -> variable) is named by the environment variable that set it.
    """
    match = _AT.match(message)
    msg, path = (match.group("msg"), match.group("path") or "") if match else (message, "")
    named = _FIELD_NAMED.match(msg)
    own = _FIELD_PREFIX.match(msg)
    if named:
        missing = named.group(1) == "missing required"
        field = named.group(2)
        hint = ""
        if not missing and root is not None:
            close = difflib.get_close_matches(field, _fields_at(root, path), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
        path, msg = f"{path}.{field}", ("missing required field" if missing else "unknown field")
        msg += hint
    elif own:  # our own "field: problem" raised from a __post_init__
        path, msg = f"{path}.{own.group(1)}", own.group(2)
    else:
        path = _name_key(path, msg, data)
        msg = msg.replace("`object`", "table").replace("`", "")
        msg = msg[:1].lower() + msg[1:]
        found, value = _lookup(data, path)
        if found and path and ", got " not in msg:
            msg += f", got {_show(value)}"
    shown = path.lstrip(".")
    if injected and shown in injected:
        shown = injected[shown]
    return one_line(f"{shown}: {msg}" if shown else msg)


def one_line(text: str) -> str:
    """``text`` with non-printable characters escaped: a key like ``"a\\nb"`` in the file must
    not split the error into several lines (or forge log lines)."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _lookup(data: Any, path: str) -> tuple[bool, Any]:
    for key, index in _STEP.findall(path):
        try:
            data = data[int(index)] if index else data[key]
        except (KeyError, IndexError, TypeError):
            return False, None
    return True, data


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _fields_at(root: type[msgspec.Struct], path: str) -> tuple[str, ...]:
    """The fields of the struct at ``path`` under ``root`` (``.gates[0]`` -> a gate's)."""
    node: msgspec.inspect.Type = msgspec.inspect.type_info(root)
    for key, index in _STEP.findall(path):
        node = _unwrap(node)
        if index and isinstance(node, (msgspec.inspect.VarTupleType, msgspec.inspect.ListType)):
            node = node.item_type
        elif key and isinstance(node, msgspec.inspect.StructType):
            fields = {f.encode_name: f.type for f in node.fields}
            if key not in fields:
                return ()
            node = fields[key]
        else:
            return ()
    node = _unwrap(node)
    return node.cls.__struct_fields__ if isinstance(node, msgspec.inspect.StructType) else ()


def _unwrap(node: msgspec.inspect.Type) -> msgspec.inspect.Type:
    """A field's type without its description or ``| None``."""
    if isinstance(node, msgspec.inspect.Metadata):
        node = node.type
    if isinstance(node, msgspec.inspect.UnionType):
        kinds = [t for t in node.types if not isinstance(t, msgspec.inspect.NoneType)]
        if len(kinds) == 1:
            return _unwrap(kinds[0])
    return node


def _name_key(path: str, msg: str, data: Any) -> str:
    """msgspec shows a table's key as ``[...]`` (``$.gates[0].tenant_weights[...]``): name the
    first entry of that table whose value is of the type the error says it got."""
    head, sep, tail = path.rpartition("[...]")
    got = _GOT.search(msg)
    if not sep or tail or "[...]" in head or not got or got.group(1) not in _KINDS:
        return path
    found, table = _lookup(data, head)
    if not found or not isinstance(table, dict):
        return path
    kinds = _KINDS[got.group(1)]
    for key, value in table.items():
        if isinstance(value, kinds):
            return f"{head}[{key!r}]"
    return path
