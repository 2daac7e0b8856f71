"""What an object store's failure means, in one line a user acts on: from an obstore exception,
whose text carries a multi-line debug dump that is never shown (a store's own code and message,
a bucket in another region with the region to set, missing credentials with what to set)."""
from __future__ import annotations

import os
import re
import urllib.error
import urllib.request
from urllib.parse import urlsplit

from pipeline.errors import RemoteDataError
from pipeline.storage.credentials import s3_settings
from pipeline.storage.urls import redact

_STATUS = re.compile(r"status(?: code)?:? (\d{3})\b", re.I)
# What a store says in an error answer's body: S3's and GCS's XML (<Code>, <Message>), GCS's JSON
_XML_CODE = re.compile(r"<Code>([^<]{1,80})</Code>")
_XML_MESSAGE = re.compile(r"<Message>([^<]{1,300})</Message>")
_JSON_MESSAGE = re.compile(r'"message"\s*:\s*"([^"\\]{1,300})"')
_XML_REGION = re.compile(r"<Region>([a-z0-9-]{2,40})</Region>")
_REGION = re.compile(r"^[a-z0-9-]{2,40}$")
REGION_LOOKUP_TIMEOUT_S = 5
# Every obstore error's debug dump names its retry_timeout setting: only a timeout that happened counts
_TIMED_OUT = re.compile(r"timed out|(?<!retry_)timeout", re.I)
_PERFORMING = re.compile(r"^.*?Error performing \w+ \S+ in [^-]*- ")
_URL = re.compile(r"https?://\S+")
# A credential provider of ours (a profile's credential_process) that failed, as obstore reports it
_PROVIDER_SAYS = re.compile(r"credential provider: RemoteDataError: ([^\n]{1,400})")
NO_CREDENTIALS = {
    "s3": ("no credentials found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE to a profile of "
           "~/.aws/credentials (or run where an instance role provides them)"),
    "gs": ("no credentials found: set GOOGLE_APPLICATION_CREDENTIALS (or GOOGLE_SERVICE_ACCOUNT) to a service "
           "account's key file, or run `gcloud auth application-default login` (or run where the instance's "
           "service account provides them)"),
}


class RemoteNotFound(RemoteDataError):
    """The object asked for is not there (404, or no such key)."""


def describe_error(error: BaseException, scheme: str = "s3", bucket: str | None = None,
                   carries_user: bool = False) -> str:
    """What happened, in words a user acts on, from an obstore exception (whose text carries
    a multi-line debug dump that is never shown) met reading a `scheme` URL (of `bucket`, where
    it has one: a bucket in another region is named with the region to set; that carries a user
    and password, or not)."""
    from obstore import exceptions as errors
    text = str(error)
    low = text.lower()
    provider = _PROVIDER_SAYS.search(text)
    if provider:
        return provider.group(1)
    if "/latest/api/token" in text or "/latest/meta-data" in text:
        return NO_CREDENTIALS["s3"]     # no keys in the environment or the profile: obstore asked the instance
    if "/computemetadata/" in low:
        return NO_CREDENTIALS["gs"]     # no key file named and no gcloud login: obstore asked the instance
    status = _STATUS.search(text)
    code = int(status.group(1)) if status else None
    if isinstance(error, (errors.NotFoundError, FileNotFoundError)) or code == 404:
        return "not found (404)"
    if isinstance(error, (errors.PermissionDeniedError, errors.UnauthenticatedError)) or code in (401, 403):
        if scheme in ("http", "https") and code == 401:
            return ("the server refused the user and password in the URL (401)" if carries_user else
                    "the server asks for a user and password (401): give them in the URL, "
                    f"{scheme}://USER:PASSWORD@host/...")
        if scheme in ("http", "https"):
            return f"access denied ({code or 403}) by the server: its access rules, or a signed URL's expiry"
        return f"access denied ({code or 403}): check the credentials (the AWS_* or GOOGLE_* variables) and the bucket's policy"
    if code is not None:
        said = _store_says(text)
        if scheme == "s3" and (code == 301 or "AuthorizationHeaderMalformed" in said):
            return _wrong_region(code, said, _XML_REGION.search(text), bucket)
        retried = code >= 500 or code == 429      # obstore retries these; another 4xx is answered at once
        return f"the server answered {code}" + (f" ({said})" if said else "") + (" after retries" if retried else "")
    if "connection refused" in low:
        return "connection refused: is the endpoint right and the server up?"
    if "dns error" in low or "failed to lookup" in low or "name or service not known" in low:
        return "unknown host: check the endpoint"
    if "invalidcertificate" in low or "certificate verify failed" in low:
        trust = "AWS_CA_BUNDLE=ca.pem (or SSL_CERT_FILE)" if scheme == "s3" else "SSL_CERT_FILE=ca.pem"
        return f"the server's certificate is not trusted here (verified by default): give its CA as {trust}, or fix the certificate"
    if "credential" in low and scheme in NO_CREDENTIALS:
        return NO_CREDENTIALS[scheme]
    if "range request not supported" in low:
        return ("the server does not answer range requests (it sends whole files): serve the folder with one "
                "that does, such as nginx or a bucket (Python's http.server does not)")
    if "received redirect without location" in low and scheme == "s3":
        return _wrong_region(301, "", None, bucket)
    if _TIMED_OUT.search(text):
        return "timed out after retries"
    summary = " ".join(text.split("\n\n")[0].split())
    summary = _URL.sub(lambda url: redact(url.group(0)), _PERFORMING.sub("", summary))   # the caller names the URL
    return f"{type(error).__name__}: {summary[:200]}"


def _store_says(text: str) -> str:
    """The store's own error code and message from the answer's body in an obstore error's text,
    on one line; empty where the body is not a store's (an HTML page, nothing)."""
    code, message = _XML_CODE.search(text), _XML_MESSAGE.search(text) or _JSON_MESSAGE.search(text)
    said = ": ".join(match.group(1).strip() for match in (code, message) if match)
    return " ".join(said.split())


def _wrong_region(code: int, said: str, named, bucket: str | None) -> str:
    """S3's answer to a request signed for another region than the bucket's: 400
    AuthorizationHeaderMalformed naming the region, or 301 with the region in a header that
    obstore does not show, which a request of our own for the bucket reads."""
    try:
        s3 = s3_settings()
    except RemoteDataError:
        s3 = {}
    configured = (s3.get("aws_region") or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
                  or "us-east-1, the default")
    region = named.group(1) if named else _bucket_region(bucket, s3.get("aws_endpoint")) if bucket else None
    if region:
        return f"the bucket is in region {region}, not {configured} (S3 answered {code}): set AWS_REGION={region}"
    return (f"the bucket is in another region than {configured} (S3 answered {code}{': ' + said if said else ''}): "
            f"set AWS_REGION to its region")


def _bucket_region(bucket: str, endpoint: str | None) -> str | None:
    """The bucket's region as S3 tells it to anyone who asks (the x-amz-bucket-region header of
    its answer to a HEAD of the bucket, whatever its status), or None."""
    # Path-style, so that a bucket name with dots meets no certificate made for one label
    url = f"{(endpoint or 'https://s3.amazonaws.com').rstrip('/')}/{bucket}"
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"),
                                    timeout=REGION_LOOKUP_TIMEOUT_S) as answer:
            region = answer.headers.get("x-amz-bucket-region")
    except urllib.error.HTTPError as answer:      # 301, 403: the header comes all the same
        region = answer.headers.get("x-amz-bucket-region")
    except (OSError, ValueError):
        return None
    return region if region and _REGION.match(region) else None


def store_error(where: str, error: BaseException) -> RemoteDataError:
    """The one line for `error`, met reading the object at `where` (a URL as shown)."""
    parts = urlsplit(where)
    what = describe_error(error, parts.scheme.lower(), parts.hostname, carries_user="@" in parts.netloc)
    return (RemoteNotFound if what.startswith("not found") else RemoteDataError)(f"{where}: {what}")
