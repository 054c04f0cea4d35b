"""The bucket API's pure parts: the SigV4 canonical query, bucket names, the Vault token's
refresh schedule and the bucket settings (no RGW or Vault needed)."""

from __future__ import annotations

import pytest

from handlers.settings.buckets import load_buckets_config
from handlers.settings.reader import ConfigError
from handlers.storage.buckets.model import BucketError
from handlers.storage.buckets.rgw import canonical_query
from handlers.storage.buckets.validation import bucket_name, user_for
from handlers.vault.client import refresh_after

pytestmark = pytest.mark.timeout(180)


def test_canonical_query_sorts_encodes_and_keeps_bare_keys():
    assert canonical_query({"uid": "p1", "display-name": "Persys bucket x", "key": ""}) == (
        "display-name=Persys%20bucket%20x&key=&uid=p1")
    assert canonical_query({"prefix": "a/b+c~d"}) == "prefix=a%2Fb%2Bc~d"


@pytest.mark.parametrize("raw", ["", " ", "ab", "-abc", "abc-", "a" * 64, "has_underscore",
                                 "a..b", "192.168.1.1", "bad/name", "ok.but space"])
def test_bad_bucket_names_are_refused_naming_the_field(raw):
    with pytest.raises(BucketError) as info:
        bucket_name(raw, "name")
    assert info.value.code == "INVALID_ARGUMENT"
    assert str(info.value).startswith("name: ")


def test_bucket_names_are_trimmed_and_lower_cased():
    assert bucket_name("  My-Bucket.1 ", "name") == "my-bucket.1"
    assert user_for("my-bucket.1") == "persys-bkt-my-bucket.1"


@pytest.mark.parametrize(("lease", "after"), [(0, 2880), (3600, 2880), (120, 96), (70, 60),
                                              (40, 30), (20, 10), (8, 4)])
def test_token_refresh_schedule(lease, after):
    assert refresh_after(lease) == pytest.approx(after)
    assert refresh_after(lease or 3600) < (lease or 3600)


def test_config_is_optional_strict_and_hides_secrets():
    assert load_buckets_config({}) is None
    base = {"PERSYS_S3_ENDPOINT": "http://rgw:8080", "PERSYS_S3_ACCESS_KEY": "AK",
            "PERSYS_S3_SECRET_KEY": "very-secret"}
    config = load_buckets_config(base)
    assert config is not None
    assert (config.region, config.admin_path, config.kv_mount, config.kv_path) == (
        "default", "admin", "secret", "persys/rgw/buckets")
    assert config.vault is None
    assert "very-secret" not in repr(config)
    for env, variable in [
        ({"PERSYS_RGW_ENDPOINT": "http://rgw"}, "PERSYS_RGW_ACCESS_KEY"),
        ({**base, "PERSYS_RGW_ENDPOINT": "rgw:8080"}, "PERSYS_RGW_ENDPOINT"),
        ({**base, "PERSYS_RGW_VAULT_PATH_PREFIX": "secret/persys"},
         "PERSYS_RGW_VAULT_PATH_PREFIX"),
        ({**base, "PERSYS_VAULT_ADDR": "http://vault:8200"}, "PERSYS_VAULT_TOKEN"),
        ({**base, "PERSYS_VAULT_ADDR": "http://v:8200", "PERSYS_VAULT_APPROLE_ROLE_ID": "r"},
         "PERSYS_VAULT_APPROLE_SECRET_ID"),
    ]:
        with pytest.raises(ConfigError, match=variable):
            load_buckets_config(env)
    vault = load_buckets_config({**base, "PERSYS_VAULT_ADDR": "http://v:8200",
                                 "PERSYS_VAULT_TOKEN": "tok-secret"})
    assert vault is not None
    assert vault.vault is not None
    assert "tok-secret" not in repr(vault)
