"""The bucket API from the environment, for the composition root.

Apart because it is the one place that turns settings into the API's clients (the Vault KV
client with its own thread pool included), so the commands take what they are given and
never read the environment.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from handlers.settings.buckets import load_buckets_config
from handlers.storage.buckets.commands import BucketCommands
from handlers.vault.client import VaultKV

log = logging.getLogger("persys.buckets")


def build_buckets(env: Mapping[str, str]) -> BucketCommands | None:
    """The bucket API from the environment; ``None`` without ``PERSYS_RGW_ENDPOINT``.

    Raises:
        ConfigError: a half or invalid bucket configuration (naming the variable).
    """
    config = load_buckets_config(env)
    if config is None:
        return None
    vault = VaultKV(config.vault, workers=config.vault_workers) if config.vault else None
    log.info("bucket API on %s region=%s vault=%s", config.endpoint, config.region,
             config.vault.addr if config.vault else "not configured")
    return BucketCommands(config, vault=vault)
