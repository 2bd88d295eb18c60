"""argparse types of the command line: a bad value is refused with the
value in the message (exit 2), before anything starts."""
from __future__ import annotations

import argparse


def listen(text: str) -> tuple[str, int]:
    """`[ADDR:]PORT` -> (addr, port); an IPv6 address goes in brackets."""
    addr, sep, port = text.rpartition(":")
    addr = addr.strip("[]") if sep else ""
    try:
        p = int(port)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not [ADDR:]PORT: {text!r}") from None
    if not 0 <= p <= 65535:
        raise argparse.ArgumentTypeError(f"port out of range: {text!r}")
    return addr or "127.0.0.1", p


def pid(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a PID: {text!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"not a PID: {text!r}")
    return v


def number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None


def nonnegative(text: str) -> float:
    v = number(text)
    if not v >= 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more: {text!r}")
    return v


def positive(text: str) -> float:
    v = number(text)
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be positive: {text!r}")
    return v


def probability(text: str) -> float:
    v = positive(text)
    if v > 1:
        raise argparse.ArgumentTypeError(f"must be at most 1: {text!r}")
    return v


def fraction(text: str) -> float:
    v = number(text)
    if not 0 <= v <= 1:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1: {text!r}")
    return v
