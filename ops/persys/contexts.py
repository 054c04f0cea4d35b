"""Named connection contexts in a YAML file, like kubectl's kubeconfig.

The file is ``$PERSYS_CONFIG``, else ``$XDG_CONFIG_HOME/persys/config.yaml``, else
``~/.config/persys/config.yaml``::

    current-context: dev
    contexts:
      dev:  {server: 127.0.0.1:8085, insecure: true}
      prod: {server: sched.example:8085, ca: ca.pem, cert: op.pem, key: op-key.pem}

A missing file is an empty configuration; a file that does not parse is an input error
naming its line. The file is written with mode 0600: it names key files.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ops.persys.errors import InputError

#: the keys a context may hold
CONTEXT_KEYS = ("server", "ca", "cert", "key", "insecure", "tls_server_name")


def config_path() -> Path:
    explicit = os.environ.get("PERSYS_CONFIG")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "persys" / "config.yaml"


@dataclass
class Config:
    path: Path
    current: str = ""
    contexts: dict[str, dict[str, Any]] = field(default_factory=dict)

    def context(self, name: str | None) -> dict[str, Any]:
        """The named context, or the current one; {} when there is none."""
        wanted = name or self.current
        if not wanted:
            return {}
        if wanted not in self.contexts:
            raise InputError(f"context {wanted!r} not found in {self.path}"
                             f" (known: {', '.join(sorted(self.contexts)) or 'none'})")
        return self.contexts[wanted]

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        body = {"current-context": self.current, "contexts": self.contexts}
        tmp = self.path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            yaml.safe_dump(body, out, sort_keys=True)
        tmp.replace(self.path)


def load_config(path: Path | None = None) -> Config:
    path = path or config_path()
    try:
        text = path.read_text()
    except FileNotFoundError:
        return Config(path)
    except OSError as exc:
        raise InputError(f"{path}: {exc.strerror}") from exc
    try:
        body = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise InputError(f"{path}{where}: not YAML: {getattr(exc, 'problem', exc)}") from exc
    if not isinstance(body, dict) or not isinstance(body.get("contexts", {}), dict):
        raise InputError(f"{path}: expected a mapping with 'contexts'")
    contexts: dict[str, dict[str, Any]] = {}
    for name, ctx in (body.get("contexts") or {}).items():
        if not isinstance(ctx, dict):
            raise InputError(f"{path}: context {name!r} is not a mapping")
        unknown = set(ctx) - set(CONTEXT_KEYS)
        if unknown:
            raise InputError(f"{path}: context {name!r}: unknown keys {sorted(unknown)}"
                             f" (known: {', '.join(CONTEXT_KEYS)})")
        contexts[str(name)] = dict(ctx)
    return Config(path, str(body.get("current-context") or ""), contexts)
