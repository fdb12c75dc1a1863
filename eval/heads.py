"""Which draft head each speculative method runs with (a `--heads` directory, the head shipped for the
target, or an untrained one when allowed), identified by the sha256 of its weights (HeadRecord.weights_digest)."""

from __future__ import annotations

import dataclasses
import inspect
import logging
from typing import Any

from jetspec_jax.api import random_head
from jetspec_jax.fingerprint import TargetIdentity
from jetspec_jax.loading.head_checkpoint import (check_head_target, load_head, no_head_message, packaged_head_path,
                                                 verify_head_files)
from jetspec_jax.models import draft_head
from jetspec_jax.target import Target

log = logging.getLogger(__name__)

ROLE_OF_METHOD = {"jetspec": "jetspec", "jetspec-tc": "jetspec", "ddtree": "bidirectional", "dflash": "bidirectional"}
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

    def load(self, target: Target, seed: int, draft_vocab: int | None = None) -> tuple[draft_head.DraftConfig, Any]:
        if self.path is None:
            if draft_vocab is not None:
                raise ValueError("a draft vocabulary needs a trained head and its token counts; an untrained "
                                 "head has neither (drop --draft-vocab or give --heads)")
            return random_head(target, ATTENTION_OF_ROLE[self.role], seed)
        return load_head(self.path, target.params["embed"].dtype, target=target, draft_vocab=draft_vocab)


def head_from_dir(role: str, path: str, target: Target | TargetIdentity) -> HeadSource:
    """Checks the head's files (not loading the weights), that it was trained for `target` and that its
    attention suits the role."""
    record = verify_head_files(path)
    check_head_target(record, target)
    cfg = record.cfg
    if isinstance(cfg.attention, str) and cfg.attention != ATTENTION_OF_ROLE[role]:
        raise ValueError(f"the {role} head at {path} has {cfg.attention} attention; that role needs a "
                         f"{ATTENTION_OF_ROLE[role]} head")
    return HeadSource(role, path, record.weights_digest(), cfg.block_size)


def resolve_heads(methods, head_dirs: dict[str, str], target: Target | TargetIdentity,
                  allow_untrained: bool) -> dict[str, HeadSource]:
    """role -> head for the roles `methods` need: the `--heads ROLE=DIR` ones, else those shipped for this
    target (matched by its fingerprint). Methods without a head are left out, with a warning."""
    unknown = sorted(set(head_dirs) - set(ATTENTION_OF_ROLE))
    if unknown:
        raise ValueError(f"unknown head role(s) {unknown}; use {' or '.join(ATTENTION_OF_ROLE)}")
    heads = {role: head_from_dir(role, path, target) for role, path in head_dirs.items()}
    for method in methods:
        role = ROLE_OF_METHOD.get(method)
        if role is None or role in heads:
            continue
        packaged = packaged_head_path(target, method)
        if packaged:
            heads[role] = head_from_dir(role, packaged, target)
        elif allow_untrained:
            log.warning("no %s head: %s runs with an untrained head (exact output, tau ~ 1)", role, method)
            heads[role] = HeadSource(role, None, None, UNTRAINED_BLOCK_SIZE)
    for method in methods:
        if method in ROLE_OF_METHOD and ROLE_OF_METHOD[method] not in heads:
            log.warning("skipping %s: %s; or give --heads %s=DIR, or --allow-untrained to run an untrained "
                        "one (exact output, tau ~ 1)", method, no_head_message(target, method),
                        ROLE_OF_METHOD[method])
    return heads
