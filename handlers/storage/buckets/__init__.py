"""The bucket API: Ceph RGW buckets with per-bucket credentials held in Vault.

Why it exists: tenants get S3 buckets on the cluster's RADOS Gateway, each with its own RGW
user and keys that can reach that bucket and nothing else. RGW is the only inventory (no etcd
records, no events): a bucket exists when RGW says so. What is kept from the Go version:
docs/compatibility.md, "Buckets".

How (and where it differs from the Go version: docs/compatibility.md, "Bucket API rules"):

* CreateBucket: validate -> HEAD -> claim the name in Vault -> create the RGW user
  ``persys-bkt-<bucket>`` with keys that RGW generates (so the secret is never in a URL or an
  RGW access log), ``max-buckets=-1`` (it cannot create buckets) and ``exclusive=true`` ->
  create the bucket (owned by the control-plane user) ->
  versioning if asked (errors surface) -> a bucket policy that grants the user's ARN
  ``s3:*`` on the bucket and its objects -> prove with the new keys that ListObjects works ->
  write ``{endpoint, region, bucket, access_key, secret_key, s3_url}`` to Vault KV v2 at
  ``<prefix>/<bucket>``. Any failure rolls back what was made (bucket, user, secret) and the
  error is answered, never swallowed; a Vault write failure answers UNAVAILABLE.
  Before any of that, the name is claimed in Vault: a placeholder ``{"state": "creating"}``
  written with check-and-set ``cas=0``, which Vault applies atomically; the final write uses
  ``cas=<claim version>``. RGW offers no atomic claim: a second PUT of the control-plane
  user's own bucket succeeds, and two concurrent user creates can both succeed even with
  ``exclusive=true`` (measured here: the first writer's keys end up refused). So a concurrent
  create of the same name, from this replica or another, gets ALREADY_EXISTS, as does a name
  with a leftover secret or user of a crashed attempt (DeleteBucket removes those). The claim
  carries a nonce and its time: a claim write whose answer was lost is read back and removed
  if it is ours, and DeleteBucket refuses (ABORTED) to remove the user of a name claimed less
  than ``CLAIM_LIVE_S`` ago (a create in progress on another replica).
* A create cancelled midway (the client's deadline, shutdown) still rolls back: an RGW call
  already running in its thread takes effect, so the cancellation waits for it to end before
  the rollback runs, and the rollback removes what the call may have made (a bucket only if
  RGW shows it owned by the control-plane user). The claim stays if the rollback could not
  remove the rest.
* GetBucket / ListBuckets fill ``owner``, ``object_count``, ``size_bytes`` and the creation and
  modification times from Admin Ops bucket stats, and ``versioning`` from GetBucketVersioning.
* DeleteBucket refuses a non-empty bucket (FAILED_PRECONDITION) unless ``force``, which makes
  RGW purge the objects (all versions) and the bucket in one Admin Ops call. A bucket owned by
  another RGW user is never deleted (Admin Ops could: FAILED_PRECONDITION). Success is
  answered only after RGW no longer has the bucket; then the user and the Vault secret are
  removed (a failure there is answered and a retry finishes the job: DeleteBucket of a missing
  bucket removes a leftover user or secret and succeeds, and NOT_FOUND only when there was none).
* GetBucketAccess does NOT return the secret key (decision): the secret is returned once, by
  CreateBucket, as the proto comment says; afterwards it is read from Vault at ``vault_path``
  by whoever Vault's policies allow. The Go version returned it on every call to anyone the
  mTLS CA trusts, agents included (docs/compatibility.md, "Bucket API rules"). The answer has
  everything else (endpoint, region, bucket, access key, vault_path, s3_url), read from Vault.
* Regions: RGW serves one zonegroup; a request ``region`` other than the configured one is
  INVALID_ARGUMENT (the Go version signed with it and reported it, without effect).

The vault-manager route of the Go version is not implemented (see handlers/settings/buckets.py).

The modules, one job each:

* ``model``: the records the API answers (``BucketInfo``, ``AccessInfo``, ``ObjectPage``), its
  error (``BucketError``) and their proto messages.
* ``validation``: bucket names and request inputs, checked before any call (pure).
* ``rgw``: the blocking RGW client (boto3 for S3, signed ``requests`` for Admin Ops).
* ``calls``: that client behind its own ``s3`` thread pool, with deadlines, and RGW's errors
  as ``BucketError``.
* ``credentials``: the Vault side: the name claim and the stored credentials.
* ``commands``: the six commands (``BucketCommands``), which compose the above.
* ``build``: the bucket API from the environment (for the composition root).

Invariants: blocking clients run only on the ``s3`` thread pool of ``calls.RgwCalls`` (and
VaultKV's ``vault`` pool), behind a semaphore of the pool's size, each call with a client
timeout and an asyncio deadline; secrets (the control-plane secret key, generated secret keys)
are never logged, never put into error messages, never written anywhere but Vault and the
CreateBucket answer. Errors are ``BucketError`` carrying the gRPC status name.
"""
