"""Which draft head each speculative method runs with (a `--heads` directory, the head shipped for the
target, or an untrained one when allowed), identified by the sha256 of its weights file."""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import logging
import os
from typing import Any

from jetspec_jax.generate import random_head
from jetspec_jax.loading.head_checkpoint import (CONFIG_FILE, WEIGHTS_FILE, config_from_json, load_head,
                                                 packaged_head_path)
from jetspec_jax.models import draft_head
from jetspec_jax.target import Target

log = logging.getLogger(__name__)

ROLE_OF_METHOD = {"jetspec": "jetspec", "ddtree": "bidirectional", "dflash": "bidirectional"}
ATTENTION_OF_ROLE = {"jetspec": "causal", "bidirectional": "bidirectional"}
UNTRAINED = "untrained"
# random_head builds DraftConfig.for_target with its default block, so read that default
UNTRAINED_BLOCK_SIZE = inspect.signature(draft_head.DraftConfig.for_target).parameters["block_size"].default


@dataclasses.dataclass(frozen=True)
class HeadSource:
    role: str
    path: str | None  # None: an untrained head (random_head)
    sha256: str | None
    block_size: int

    @property
    def name(self) -> str:
        return self.path or UNTRAINED

    def load(self, target: Target, seed: int) -> tuple[draft_head.DraftConfig, Any]:
        if self.path is None:
            return random_head(target, ATTENTION_OF_ROLE[self.role], seed)
        return load_head(self.path, target.params["embed"].dtype)


def file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def head_from_dir(role: str, path: str) -> HeadSource:
    """Reads the config (not the weights) and checks the head's attention suits the role."""
    config_path, weights_path = os.path.join(path, CONFIG_FILE), os.path.join(path, WEIGHTS_FILE)
    if not (os.path.isfile(config_path) and os.path.isfile(weights_path)):
        raise FileNotFoundError(f"no draft head at {path} for {role} (expected {CONFIG_FILE} and "
                                f"{WEIGHTS_FILE})")
    with open(config_path, encoding="utf-8") as f:
        cfg = config_from_json(json.load(f))
    if isinstance(cfg.attention, str) and cfg.attention != ATTENTION_OF_ROLE[role]:
        raise ValueError(f"the {role} head at {path} has {cfg.attention} attention; that role needs a "
                         f"{ATTENTION_OF_ROLE[role]} head")
    return HeadSource(role, path, file_sha256(weights_path), cfg.block_size)


def resolve_heads(methods, head_dirs: dict[str, str], target_source: str,
                  allow_untrained: bool) -> dict[str, HeadSource]:
    """role -> head for the roles `methods` need. Methods without a head are left out, with a warning."""
    unknown = sorted(set(head_dirs) - set(ATTENTION_OF_ROLE))
    if unknown:
        raise ValueError(f"unknown head role(s) {unknown}; use {' or '.join(ATTENTION_OF_ROLE)}")
    heads = {role: head_from_dir(role, path) for role, path in head_dirs.items()}
    for method in methods:
        role = ROLE_OF_METHOD.get(method)
        if role is None or role in heads:
            continue
        packaged = packaged_head_path(target_source, method)
        if packaged:
            heads[role] = head_from_dir(role, packaged)
        elif allow_untrained:
            log.warning("no %s head: %s runs with an untrained head (exact output, tau ~ 1)", role, method)
            heads[role] = HeadSource(role, None, None, UNTRAINED_BLOCK_SIZE)
    for method in methods:
        if method in ROLE_OF_METHOD and ROLE_OF_METHOD[method] not in heads:
            log.warning("skipping %s: no trained %s head for this target; give --heads %s=DIR, or "
                        "--allow-untrained to run an untrained one (exact output, tau ~ 1)",
                        method, ROLE_OF_METHOD[method], ROLE_OF_METHOD[method])
    return heads
