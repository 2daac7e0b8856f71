"""Where a store's credentials come from, gathered for obstore, which reads only the environment.

S3, the AWS way: the AWS_* variables first, then the profile in the shared files that `aws configure`
writes (`~/.aws/credentials` and `~/.aws/config`, or AWS_SHARED_CREDENTIALS_FILE and
AWS_CONFIG_FILE; the profile named by AWS_PROFILE, else `default`), as the AWS CLI and SDKs read
them: its keys, region, endpoint and CA bundle (or AWS_CA_BUNDLE), or its `credential_process`,
run when keys are needed. A profile that gets its credentials by assuming a role or by SSO is not
run here: that is one line saying how to give it a `credential_process` through the AWS CLI. Web
identity (AWS_WEB_IDENTITY_TOKEN_FILE, as on EKS) and a container's role are left to obstore.

Where nothing gives credentials (S3 or GCS), obstore asks the instance's metadata service, as on a
cloud instance with a role. Off one, where nothing answers there, it would wait through its retries
(a minute) before saying so: the service is asked first here, for a second, as the AWS SDKs do.
"""
from __future__ import annotations

import configparser
import json
import os
import shlex
import subprocess
import urllib.error
import urllib.request
from datetime import datetime, timedelta, timezone
from pathlib import Path

from pipeline.errors import RemoteDataError

METADATA_TIMEOUT_S = 1.0       # the AWS SDKs' own wait for the instance metadata service
PROCESS_TIMEOUT_S = 60         # for a credential_process (one waiting on a login would wait for ever)
PROCESS_REFRESH_MARGIN = timedelta(minutes=5)     # keys this near their expiry are asked for again
KEYS = ("aws_access_key_id", "aws_secret_access_key", "aws_session_token")
# What a profile may get its credentials by, which only the AWS CLI or an SDK runs
RUN_BY_THE_SDK = ("role_arn", "sso_session", "sso_start_url", "web_identity_token_file")


def s3_options() -> dict:
    """obstore's `from_url` keyword arguments for S3: `config`, the endpoint, region and keys that
    the environment or the profile gives, and `credential_provider` where the profile's
    `credential_process` gives the keys (not run yet)."""
    env = os.environ
    settings: dict = {}
    options = {"config": settings}
    endpoint = env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")
    if endpoint:
        settings["aws_endpoint"] = endpoint
    named = _named_profile()
    keys_given = bool(env.get("AWS_ACCESS_KEY_ID") or env.get("AWS_WEB_IDENTITY_TOKEN_FILE"))
    region_given = bool(env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION"))
    if keys_given and region_given and endpoint and not named:
        return options      # nothing a profile says would be used
    name = named or "default"
    profile, files = _profile(name)
    if profile is None:
        if named:
            raise RemoteDataError(f"AWS_PROFILE={named}: no such profile in {' or '.join(map(str, files))}")
        profile = {}
    if not endpoint and profile.get("endpoint_url"):
        settings["aws_endpoint"] = profile["endpoint_url"]
    if not region_given and profile.get("region"):
        settings["aws_region"] = profile["region"]
    if keys_given:
        return options
    if profile.get("aws_access_key_id") and profile.get("aws_secret_access_key"):
        settings.update({key: profile[key] for key in KEYS if profile.get(key)})
    elif profile.get("credential_process"):
        options["credential_provider"] = CredentialProcess(profile["credential_process"], name)
    elif any(profile.get(way) for way in RUN_BY_THE_SDK):
        way = next(way for way in RUN_BY_THE_SDK if profile.get(way))
        raise RemoteDataError(
            f"AWS profile {name} gets its credentials through {way}, which only the AWS CLI or an SDK runs: give the "
            f"job a profile with credential_process = aws configure export-credentials --profile {name} --format process")
    return options


def s3_settings() -> dict:
    """obstore's S3 config (`s3_options`' `config`)."""
    return s3_options()["config"]


class CredentialProcess:
    """obstore's credential provider for a profile's `credential_process`: the command is run, as
    the AWS CLI runs it, for keys at the start and again whenever those it gave are about to expire
    (obstore asks then), so a run of days outlives credentials of an hour. It travels to the fetch
    process with the keys it got last."""

    def __init__(self, command: str, profile: str):
        self.command, self.profile = command, profile
        self.last: dict | None = None

    def __call__(self) -> dict:
        last = self.last
        if last is not None and (last["expires_at"] is None or
                                 last["expires_at"] - datetime.now(timezone.utc) > PROCESS_REFRESH_MARGIN):
            return last
        where = f"the credential_process of AWS profile {self.profile}"
        try:
            result = subprocess.run(shlex.split(self.command), stdin=subprocess.DEVNULL, capture_output=True,
                                    text=True, timeout=PROCESS_TIMEOUT_S)
        except (OSError, ValueError, subprocess.TimeoutExpired) as error:
            raise RemoteDataError(f"{where} did not run ({getattr(error, 'strerror', None) or error})") from None
        if result.returncode != 0:
            said = (result.stderr.strip().splitlines() or [""])[-1][:200]
            raise RemoteDataError(f"{where} exited with {result.returncode}" + (f": {said}" if said else ""))
        try:     # its output holds the secret: never shown
            given = json.loads(result.stdout)
            expires = given.get("Expiration")
            expires_at = datetime.fromisoformat(expires.replace("Z", "+00:00")) if expires else None
            if expires_at is not None and expires_at.tzinfo is None:
                expires_at = expires_at.replace(tzinfo=timezone.utc)      # the AWS CLI's times are UTC
            self.last = {"access_key_id": given["AccessKeyId"], "secret_access_key": given["SecretAccessKey"],
                         "token": given.get("SessionToken"), "expires_at": expires_at}
        except (ValueError, KeyError, TypeError, AttributeError):
            raise RemoteDataError(f"{where} did not print the JSON the AWS CLI reads (Version, AccessKeyId, "
                                  f"SecretAccessKey, SessionToken, Expiration)") from None
        return self.last


def s3_ca_bundle() -> str | None:
    """The PEM text of the CA certificates to trust besides the system's for S3 (a store inside
    the cluster with a private CA): AWS_CA_BUNDLE, else the profile's `ca_bundle`."""
    path = os.environ.get("AWS_CA_BUNDLE")
    if not path:
        path = (_profile(_named_profile() or "default")[0] or {}).get("ca_bundle")
    if not path:
        return None
    try:
        return Path(path).expanduser().read_text(encoding="ascii")
    except (OSError, UnicodeDecodeError) as error:
        reason = error.strerror if isinstance(error, OSError) else "not a PEM file"
        raise RemoteDataError(f"{path}: the CA bundle for S3 (AWS_CA_BUNDLE or the profile's ca_bundle) cannot be "
                              f"read ({reason})") from None


def _named_profile() -> str | None:
    return os.environ.get("AWS_PROFILE") or os.environ.get("AWS_DEFAULT_PROFILE")


def _profile(name: str) -> tuple[dict | None, list[Path]]:
    """The profile's settings, the credentials file's over the config file's (None where neither
    file has it), and the two files."""
    credentials = Path(os.environ.get("AWS_SHARED_CREDENTIALS_FILE") or Path.home() / ".aws" / "credentials")
    config = Path(os.environ.get("AWS_CONFIG_FILE") or Path.home() / ".aws" / "config")
    # The config file names a profile `[profile NAME]`, the credentials file `[NAME]`; both say `[default]`
    sections = [(config, [f"profile {name}"] + (["default"] if name == "default" else [])), (credentials, [name])]
    settings = None
    for path, names in sections:
        parser = _read(path)
        for section in names:
            if parser.has_section(section):
                settings = {**(settings or {}), **{key: value.strip() for key, value in parser.items(section)}}
    return settings, [credentials, config]


def _read(path: Path) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(interpolation=None, default_section="\0none")
    try:
        parser.read_string(path.expanduser().read_text(encoding="utf-8"), source=str(path))
    except FileNotFoundError:
        pass
    except (OSError, UnicodeDecodeError, configparser.Error) as error:
        # The parser's message may quote a line of the file, which holds secrets: name the file only
        reason = error.strerror if isinstance(error, OSError) else "not an INI file the AWS CLI reads"
        raise RemoteDataError(f"{path}: cannot be read ({reason})") from None
    return parser


def instance_answers(scheme: str, options: dict) -> bool:
    """False where obstore, given `options` (from `s3_options`), would ask the instance's metadata
    service for credentials (nothing else gives them) and nothing answers there within a second;
    True otherwise."""
    env = os.environ
    if scheme == "s3":
        if (options.get("config", {}).get("aws_access_key_id") or options.get("credential_provider")
                or any(env.get(name) for name in ("AWS_ACCESS_KEY_ID", "AWS_WEB_IDENTITY_TOKEN_FILE",
                                                  "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
                                                  "AWS_CONTAINER_CREDENTIALS_FULL_URI"))
                or env.get("AWS_SKIP_SIGNATURE", "").lower() == "true"):
            return True
        endpoint = (env.get("AWS_METADATA_ENDPOINT") or "http://169.254.169.254").rstrip("/")
        # IMDSv2's first request, as obstore makes it
        return _answers(urllib.request.Request(f"{endpoint}/latest/api/token", method="PUT",
                                               headers={"X-aws-ec2-metadata-token-ttl-seconds": "21600"}))
    if scheme == "gs":
        if (any(env.get(name) for name in ("GOOGLE_APPLICATION_CREDENTIALS", "GOOGLE_SERVICE_ACCOUNT",
                                           "GOOGLE_SERVICE_ACCOUNT_PATH", "GOOGLE_SERVICE_ACCOUNT_KEY"))
                or env.get("GOOGLE_SKIP_SIGNATURE", "").lower() == "true"
                or (Path.home() / ".config" / "gcloud" / "application_default_credentials.json").exists()):
            return True
        hosts = (env.get("GCE_METADATA_HOST") or env.get("GCE_METADATA_ROOT") or "metadata.google.internal",
                 env.get("GCE_METADATA_IP") or "169.254.169.254")
        return any(_answers(urllib.request.Request(f"http://{host}/computeMetadata/v1/",
                                                   headers={"Metadata-Flavor": "Google"})) for host in hosts)
    return True


def _answers(request: urllib.request.Request) -> bool:
    """Whether an HTTP server answers the request at all (any status)."""
    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))     # never through a proxy
    try:
        with direct.open(request, timeout=METADATA_TIMEOUT_S):
            return True
    except urllib.error.HTTPError:
        return True
    except (OSError, ValueError):
        return False
