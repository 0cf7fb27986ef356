"""URL and storage-option masking (store/storage/credentials.py): presigned S3, signed GCS and
Azure SAS URLs keep scheme, host, path and non-secret parameters, lose their credentials;
`url_identity` is stable across signings of one object and tells two objects apart."""

from __future__ import annotations

import pytest

from harvest.store.storage.credentials import (known_secrets, mask_text, redact_attrs,
                                               redact_options, redact_url, scrub, url_identity,
                                               url_origin)

S3 = ("https://bucket.s3.amazonaws.com/data/docs.jsonl?X-Amz-Algorithm=AWS4-HMAC-SHA256"
      "&X-Amz-Credential=AKIASECRETCRED%2F20250101%2Fus-east-1%2Fs3%2Faws4_request"
      "&X-Amz-Date=20250101T000000Z&X-Amz-Expires=3600&X-Amz-SignedHeaders=host"
      "&X-Amz-Security-Token=SECRETSESSION&X-Amz-Signature=SECRETSIG0123&versionId=v7")
GCS = ("https://storage.googleapis.com/b/o.parquet?X-Goog-Algorithm=GOOG4-RSA-SHA256"
       "&X-Goog-Credential=SECRETGCRED%40p.iam&X-Goog-Date=20250101T000000Z&X-Goog-Expires=900"
       "&X-Goog-SignedHeaders=host&X-Goog-Signature=SECRETGSIG&generation=42")
SAS = ("https://acct.blob.core.windows.net/c/docs.jsonl?sv=2022-11-02&ss=b&srt=o&sp=r"
       "&se=2025-01-02T00:00:00Z&st=2025-01-01T00:00:00Z&spr=https&sig=SECRETSAS%3D")
GENERIC = "https://h.example/x.jsonl?token=SECRETTOK&api_key=SECRETKEY&access_token=SECRETAT&page=2"
SECRETS = ("SECRETCRED", "SECRETSESSION", "SECRETSIG", "SECRETGCRED", "SECRETGSIG", "SECRETSAS",
           "SECRETTOK", "SECRETKEY", "SECRETAT")


@pytest.mark.parametrize("url", [S3, GCS, SAS, GENERIC])
def test_query_credentials_are_masked_and_the_rest_kept(url):
    shown = redact_url(url)
    assert not any(s in shown for s in SECRETS), shown
    assert shown.split("?")[0] == url.split("?")[0]  # scheme, host, path
    assert shown.count("***") >= 1


def test_useful_parameters_survive():
    shown = redact_url(S3)
    for kept in ("X-Amz-Date=20250101T000000Z", "X-Amz-Expires=3600", "versionId=v7",
                 "X-Amz-Algorithm=AWS4-HMAC-SHA256", "X-Amz-Signature=***",
                 "X-Amz-Credential=***", "X-Amz-Security-Token=***"):
        assert kept in shown, shown
    sas = redact_url(SAS)
    assert "se=2025-01-02T00:00:00Z" in sas and "sp=r" in sas and "sig=***" in sas
    assert "page=2" in redact_url(GENERIC)
    assert redact_url("s3://bucket/x") == "s3://bucket/x"
    assert redact_url("s3://AKIA:sekrit@bucket/x") == "s3://***@bucket/x"


def test_urls_inside_messages_are_masked():
    text = f"cannot load data.source={S3!r}: FileNotFoundError: {GCS} (and {SAS})"
    out = mask_text(text)
    assert not any(s in out for s in SECRETS), out
    assert "bucket.s3.amazonaws.com/data/docs.jsonl" in out and "FileNotFoundError" in out


def test_identity_is_the_same_for_two_signings_and_differs_between_objects():
    resigned = (S3.replace("SECRETSIG0123", "OTHERSIG").replace("20250101T000000Z", "20250301T1")
                .replace("AKIASECRETCRED", "AKIAOTHER").replace("SECRETSESSION", "OTHERSESSION"))
    assert url_identity(S3) == url_identity(resigned)
    assert url_identity(S3) == "https://bucket.s3.amazonaws.com/data/docs.jsonl?versionId=v7"
    assert url_identity(S3.replace("docs.jsonl", "other.jsonl")) != url_identity(S3)
    assert url_identity(S3.replace("versionId=v7", "versionId=v8")) != url_identity(S3)
    assert url_identity(GCS) == "https://storage.googleapis.com/b/o.parquet?generation=42"
    assert url_identity(SAS) == "https://acct.blob.core.windows.net/c/docs.jsonl"
    assert url_identity(GENERIC) == "https://h.example/x.jsonl?page=2"
    assert url_identity("https://u:p@h/x.jsonl") == "https://h/x.jsonl"
    # nothing to drop: the very same string (content keys of older stores stay equal)
    for same in ("pydoc", "/data/x?.jsonl", "s3://b/p/*.parquet", "https://h/x.jsonl?page=1#a",
                 "user/dataset"):
        assert url_identity(same) == same
    # SAS-looking names without a signature select data: kept
    assert url_identity("https://h/x?sp=1&se=2") == "https://h/x?sp=1&se=2"
    assert not any(s in url_identity(u) for u in (S3, GCS, SAS, GENERIC) for s in SECRETS)


def test_auth_headers_and_nested_options_are_masked():
    so = {"key": "AKIAKEY", "secret": "SECRETVALUE", "endpoint_url": "http://127.0.0.1:9000",
          "client_kwargs": {"headers": {"Authorization": "Bearer SECRETBEARER",
                                        "x-amz-security-token": "SECRETSTS",
                                        "Cookie": "session=SECRETCOOKIE", "Accept": "json"},
                            "region_name": "us-east-1"},
          "headers": {"x-api-key": "SECRETAPIKEY"}, "sas_token": "SECRETSASTOKEN",
          "connection_string": "DefaultEndpointsProtocol=https;AccountKey=SECRETACCOUNTKEY"}
    shown = redact_options(so)
    flat = str(shown)
    for s in ("AKIAKEY", "SECRETVALUE", "SECRETBEARER", "SECRETSTS", "SECRETCOOKIE",
              "SECRETAPIKEY", "SECRETSASTOKEN", "SECRETACCOUNTKEY"):
        assert s not in flat, flat
    assert shown["endpoint_url"] == "http://127.0.0.1:9000"
    assert shown["client_kwargs"]["region_name"] == "us-east-1"
    assert shown["client_kwargs"]["headers"]["Accept"] == "json"
    assert redact_options(None) is None
    # a library that echoes the bearer token alone, or the header, is scrubbed too
    assert "SECRETBEARER" in known_secrets(so)
    assert "SECRETBEARER" not in scrub("401: bad token SECRETBEARER", so)
    # attributes keep run facts whose names merely contain "token"
    kept = redact_attrs({"bos_token": "<s>", "tokens_column": "ids", "tokenizer": "gpt2",
                         "session_token": "SECRETSESS"})
    assert kept == {"bos_token": "<s>", "tokens_column": "ids", "tokenizer": "gpt2",
                    "session_token": "***"}


def test_a_webhook_is_named_by_its_host_only():
    assert url_origin("https://hooks.slack.com/services/T0/B0/SECRETHOOK") == \
        "https://hooks.slack.com/…"
    assert "SECRET" not in url_origin("https://u:SECRET@h.example:8443/p?token=SECRET")
