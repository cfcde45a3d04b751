"""Tokenizer and parser for allocator configuration strings.

The grammar is PyTorch's: ``key:value`` pairs separated by ``,``; the
characters ``, : [ ]`` are tokens of their own and whitespace is dropped
everywhere, even inside a value (``max_split_size_mb: 2 0`` is 20), exactly as
PyTorch's ConfigTokenizer does. Unlike PyTorch, separators are enforced and
every mistake raises :class:`ConfigStringError` pointing into the string.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

from accel._errors import AllocatorConfigError
from accel.allocator._config_keys import (
    KEYS_BY_NAME,
    MAX_MIB,
    MIB,
    ROUNDUP_SLOTS,
    KeySpec,
    ValueProblem,
    nearest_key,
    parse_bool,
    parse_float,
    parse_uint,
)

__all__ = ["ConfigStringError", "RoundupList", "Setting", "parse_settings", "roundup_from_list"]

_SPECIALS = ",:[]"
# std::isspace in the C locale: what PyTorch drops.
_SPACES = " \t\n\r\v\f"


class ConfigStringError(AllocatorConfigError):
    """An allocator configuration string is malformed or holds a bad value.

    ``text`` is the whole string, ``position`` the index of the offending
    character (``len(text)`` when something is missing at the end), ``end``
    the index after the offending token, ``origin`` where the string came
    from (``"ACCEL_ALLOC_CONF"``, ``"set_settings()"``...), ``reason`` the
    problem alone and ``suggestion`` the nearest known key for a misspelt one.

    >>> from accel.allocator import ConfigStringError
    >>> from accel.allocator import parse
    >>> try:
    ...     parse("max_split_size:128")
    ... except ConfigStringError as exc:
    ...     (exc.position, exc.suggestion)
    (0, 'max_split_size_mb')
    """

    def __init__(
        self,
        text: str,
        position: int,
        end: int,
        reason: str,
        *,
        origin: str = "parse()",
        suggestion: str | None = None,
    ) -> None:
        self.text = text
        self.position = position
        self.end = max(end, position + 1)
        self.reason = reason
        self.origin = origin
        self.suggestion = suggestion
        super().__init__(self._render())

    def __reduce__(self) -> tuple[object, ...]:
        return (
            _rebuild_error,
            (self.text, self.position, self.end, self.reason, self.origin, self.suggestion),
        )

    def _render(self) -> str:
        shown = "".join(" " if ch in _SPACES or not ch.isprintable() else ch for ch in self.text)
        marker = " " * (self.position + 1) + "^" * (self.end - self.position)
        return (
            f"invalid allocator configuration in {self.origin} at position {self.position}: "
            f"{self.reason}\n    '{shown}'\n    {marker}"
        )


def _rebuild_error(
    text: str, position: int, end: int, reason: str, origin: str, suggestion: str | None
) -> ConfigStringError:
    return ConfigStringError(text, position, end, reason, origin=origin, suggestion=suggestion)


# Users meet it as accel.allocator.ConfigStringError; say so in tracebacks.
ConfigStringError.__module__ = "accel.allocator"


@dataclass(frozen=True)
class _Token:
    text: str
    start: int
    end: int
    """Index after the token's last character in the original string."""

    @property
    def special(self) -> bool:
        return self.text in _SPECIALS


@dataclass(frozen=True)
class RoundupList:
    """A ``[B:D,...,>:D]`` value; its table depends on what the same string set before."""

    entries: tuple[tuple[int | None, int], ...]


@dataclass(frozen=True)
class Setting:
    """One ``key:value`` of a string, parsed and checked on its own."""

    spec: KeySpec
    written: str
    """The key as written (an alias such as release_lock_on_hipmalloc stays visible)."""
    value: object
    key_start: int
    value_start: int
    value_end: int


def _tokenize(text: str) -> list[_Token]:
    tokens: list[_Token] = []
    chars: list[str] = []
    start = end = 0
    for index, ch in enumerate(text):
        if ch in _SPECIALS:
            if chars:
                tokens.append(_Token("".join(chars), start, end))
                chars = []
            tokens.append(_Token(ch, index, index + 1))
        elif ch not in _SPACES:
            if not chars:
                start = index
            chars.append(ch)
            end = index + 1
    if chars:
        tokens.append(_Token("".join(chars), start, end))
    return tokens


class _Parser:
    def __init__(self, text: str, origin: str) -> None:
        self.text = text
        self.origin = origin
        self.tokens = _tokenize(text)
        self.i = 0

    def fail(self, start: int, end: int, reason: str, suggestion: str | None = None) -> ConfigStringError:
        return ConfigStringError(
            self.text, start, end, reason, origin=self.origin, suggestion=suggestion
        )

    def peek(self) -> _Token | None:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def at_end_error(self, reason: str) -> ConfigStringError:
        return self.fail(len(self.text), len(self.text), reason)

    def parse(self) -> list[Setting]:
        settings: list[Setting] = []
        while (token := self.peek()) is not None:
            settings.append(self.setting(token, first=not settings))
            separator = self.peek()
            if separator is None:
                break
            if separator.text != ",":
                raise self.fail(
                    separator.start,
                    separator.end,
                    f"expected ',' before '{separator.text}' (settings are separated by commas)",
                )
            self.i += 1  # one trailing comma is allowed, as in PyTorch
        return settings

    def setting(self, token: _Token, *, first: bool) -> Setting:
        if token.special:
            if token.text == "," and not first:
                reason = "empty setting between two commas"
            else:
                reason = f"expected a key, found '{token.text}'"
            raise self.fail(token.start, token.end, reason)
        spec = KEYS_BY_NAME.get(token.text)
        if spec is None:
            raise self.unknown_key(token)
        self.i += 1
        colon = self.peek()
        if colon is None or colon.text != ":":
            found = "the end of the string" if colon is None else f"'{colon.text}'"
            where = (colon.start, colon.end) if colon else (len(self.text), len(self.text))
            raise self.fail(
                *where, f"expected ':' after '{token.text}', found {found} (write {token.text}:<value>)"
            )
        self.i += 1
        value_token = self.peek()
        if value_token is None:
            raise self.at_end_error(f"'{token.text}' has no value")
        value: object  # a RoundupList for roundup keys, else what _convert made of the word
        if value_token.text == "[":
            if spec.kind != "roundup":
                raise self.fail(
                    value_token.start, value_token.end, f"'{spec.key}' takes a single value, not a list"
                )
            value, end = self.roundup_list(value_token)
        elif value_token.special:
            raise self.fail(
                value_token.start, value_token.end, f"'{token.text}' has no value before '{value_token.text}'"
            )
        else:
            self.i += 1
            try:
                value = _convert(spec, value_token.text)
            except ValueProblem as exc:
                suggestion = _choice_suggestion(spec, value_token.text)
                reason = f"bad value for {token.text}: {exc}"
                if suggestion:
                    reason += f" (did you mean {suggestion}?)"
                raise self.fail(value_token.start, value_token.end, reason, suggestion) from None
            end = value_token.end
        return Setting(spec, token.text, value, token.start, value_token.start, end)

    def unknown_key(self, token: _Token) -> ConfigStringError:
        if "=" in token.text:
            name, _, _ = token.text.partition("=")
            offset = token.text.index("=")
            # Map the offset back through any dropped whitespace.
            position = _original_index(self.text, token.start, offset)
            return self.fail(
                position,
                position + 1,
                f"use ':' between a key and its value, not '=' (write {name}:<value>)",
            )
        suggestion = nearest_key(token.text)
        if suggestion:
            reason = f"unknown key '{token.text}' (did you mean {suggestion}?)"
        else:
            reason = (
                f"unknown key '{token.text}' (`python -m accel config --keys` lists the known keys)"
            )
        return self.fail(token.start, token.end, reason, suggestion)

    def roundup_list(self, opening: _Token) -> tuple[RoundupList, int]:
        """Parse ``[B:D,...,>:D]``; returns the entries and the end position."""
        self.i += 1
        entries: list[tuple[int | None, int]] = []
        previous: tuple[int, _Token] | None = None
        while True:
            token = self.peek()
            if token is None:
                raise self.at_end_error(
                    f"the list opened at position {opening.start} is not closed with ']'"
                )
            if token.text == "]":
                self.i += 1
                return RoundupList(tuple(entries)), token.end
            if entries and entries[-1][0] is None:
                raise self.fail(token.start, token.end, "'>' must be the last entry of the list")
            if token.special:
                raise self.fail(
                    token.start, token.end, f"expected a boundary in MiB or '>', found '{token.text}'"
                )
            boundary: int | None = None
            if token.text != ">":
                try:
                    boundary = parse_uint(token.text)
                    if boundary == 0 or boundary & (boundary - 1):
                        raise ValueProblem(f"{boundary} is not a power of two")
                except ValueProblem as exc:
                    raise self.fail(token.start, token.end, f"bad roundup boundary (MiB): {exc}") from None
                if previous is not None and boundary <= previous[0]:
                    raise self.fail(
                        token.start,
                        token.end,
                        f"roundup boundaries must increase: {boundary} follows {previous[0]}",
                    )
                previous = (boundary, token)
            self.i += 1
            colon = self.peek()
            if colon is None or colon.text != ":":
                where = (colon.start, colon.end) if colon else (len(self.text), len(self.text))
                raise self.fail(
                    *where,
                    f"expected ':' after '{token.text}' in the list (write {token.text}:<divisions>)",
                )
            self.i += 1
            value_token = self.peek()
            if value_token is None:
                raise self.at_end_error(f"'{token.text}:' has no divisions")
            if value_token.special:
                raise self.fail(
                    value_token.start,
                    value_token.end,
                    f"expected divisions after '{token.text}:', found '{value_token.text}'",
                )
            try:
                divisions = parse_uint(value_token.text)
                if divisions & (divisions - 1):
                    raise ValueProblem(f"{divisions} is neither 0 nor a power of two")
            except ValueProblem as exc:
                raise self.fail(value_token.start, value_token.end, f"bad roundup divisions: {exc}") from None
            entries.append((boundary, divisions))
            self.i += 1
            separator = self.peek()
            if separator is not None and separator.text == ",":
                self.i += 1
            elif separator is None or separator.text != "]":
                where = (separator.start, separator.end) if separator else (len(self.text), len(self.text))
                found = f"'{separator.text}'" if separator else "the end of the string"
                raise self.fail(*where, f"expected ',' or ']' in the list, found {found}")


def _original_index(text: str, start: int, offset: int) -> int:
    """Index in ``text`` of the ``offset``-th non-space character from ``start``."""
    seen = -1
    for index in range(start, len(text)):
        if text[index] not in _SPACES:
            seen += 1
            if seen == offset:
                return index
    return len(text)


def _choice_suggestion(spec: KeySpec, word: str) -> str | None:
    if not spec.choices:
        return None
    lowered = {choice.lower(): choice for choice in spec.choices}
    if word.lower() in lowered:
        return lowered[word.lower()]
    match = difflib.get_close_matches(word.lower(), list(lowered), n=1, cutoff=0.6)
    return lowered[match[0]] if match else None


def _convert(spec: KeySpec, word: str) -> object:
    """The value of ``spec`` written as ``word``, checked on its own."""
    field = spec.field
    if spec.kind == "bool":
        return parse_bool(word)
    if spec.kind == "choice":
        if word not in spec.choices:
            raise ValueProblem(f"expected one of {', '.join(spec.choices)}, got '{word}'")
        return word
    if spec.kind == "float":
        value = parse_float(word)
        if field == "garbage_collection_threshold" and not 0.0 < value < 1.0:
            raise ValueProblem(f"{word} is out of range; it must be in (0.0, 1.0), both ends excluded")
        if field == "per_process_memory_fraction" and not 0.0 <= value <= 1.0:
            raise ValueProblem(f"{word} is out of range; it must be in [0.0, 1.0]")
        return value
    if spec.kind == "roundup":
        divisions = parse_uint(word)
        if divisions == 0 or divisions & (divisions - 1):
            raise ValueProblem(
                f"{divisions} is not a power of two (use the list form to give 0 to some ranges)"
            )
        return (divisions,) * ROUNDUP_SLOTS
    if spec.kind == "uint":  # pinned_num_register_threads
        threads = parse_uint(word)
        if threads == 0 or threads & (threads - 1) or threads > 128:
            raise ValueProblem(f"{threads} is not a power of two between 1 and 128")
        return threads
    if field == "max_split_size" and word == "-1":
        return None
    mib = parse_uint(word, maximum=MAX_MIB)
    if field == "large_segment_size" and mib <= 10:
        raise ValueProblem(f"{mib} is out of range; it must be greater than 10 (MiB)")
    if field == "pinned_reserve_segment_size" and mib == 0:
        raise ValueProblem("0 is out of range; it must be greater than 0 (MiB)")
    return mib * MIB


def roundup_from_list(
    value: RoundupList, start: tuple[int, ...] = (0,) * ROUNDUP_SLOTS
) -> tuple[int, ...]:
    """The 16-slot table PyTorch builds from ``[B:D,...,>:D]`` (``None`` is ``>``).

    The first boundary also fills every slot below its own; ``>`` fills every
    slot after the last boundary (after slot 0 when it comes alone). Slots no
    entry reaches keep their ``start`` value: zeros, unless the same string
    set the key before (PyTorch resets the table per string, not per key).
    """
    entries = value.entries
    table = list(start)
    last = 0
    for index, (boundary, divisions) in enumerate(entries):
        if boundary is None:
            table[last + 1 :] = [divisions] * (ROUNDUP_SLOTS - last - 1)
            continue
        slot = min(boundary.bit_length() - 1, ROUNDUP_SLOTS - 1)
        if index == 0:
            table[:slot] = [divisions] * slot
        table[slot] = divisions
        last = slot
    return tuple(table)


def parse_settings(text: str, origin: str) -> list[Setting]:
    """Every ``key:value`` of ``text`` in order; raises ConfigStringError."""
    if not isinstance(text, str):
        raise AllocatorConfigError(
            f"an allocator configuration must be a string such as 'expandable_segments:True', "
            f"got {type(text).__name__}"
        )
    return _Parser(text, origin).parse()
