"""The S3 settings a user has given the AWS way, gathered for obstore, which reads only the
environment: the AWS_* variables first, then the profile in the shared files that `aws configure`
writes (`~/.aws/credentials` and `~/.aws/config`, or AWS_SHARED_CREDENTIALS_FILE and
AWS_CONFIG_FILE; the profile named by AWS_PROFILE, else `default`), as the AWS CLI and SDKs read
them: its keys, region and endpoint.

A profile that gets its credentials by running something (assuming a role, SSO, a
`credential_process`) is not run here: that is one line saying how to export what it gives. With
no keys anywhere, obstore asks the instance's role (the metadata service), as on EC2, and web
identity (AWS_WEB_IDENTITY_TOKEN_FILE, as on EKS) is left to it too.
"""
from __future__ import annotations

import configparser
import os
from pathlib import Path

from pipeline.datasets import RemoteDataError

KEYS = ("aws_access_key_id", "aws_secret_access_key", "aws_session_token")
# What a profile may get its credentials by, which only the AWS CLI or an SDK runs
RUN_BY_THE_SDK = ("credential_process", "role_arn", "sso_session", "sso_start_url", "web_identity_token_file")


def s3_settings() -> dict:
    """obstore's S3 config: the endpoint, region and keys that the environment or the profile gives."""
    env = os.environ
    settings = {}
    endpoint = env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")
    if endpoint:
        settings["aws_endpoint"] = endpoint
    named = env.get("AWS_PROFILE") or env.get("AWS_DEFAULT_PROFILE")
    keys_given = bool(env.get("AWS_ACCESS_KEY_ID") or env.get("AWS_WEB_IDENTITY_TOKEN_FILE"))
    region_given = bool(env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION"))
    if keys_given and region_given and endpoint and not named:
        return settings      # nothing a profile says would be used
    profile, files = _profile(named or "default")
    if profile is None:
        if named:
            raise RemoteDataError(f"AWS_PROFILE={named}: no such profile in {' or '.join(map(str, files))}")
        profile = {}
    if not endpoint and profile.get("endpoint_url"):
        settings["aws_endpoint"] = profile["endpoint_url"]
    if not region_given and profile.get("region"):
        settings["aws_region"] = profile["region"]
    if not keys_given:
        if profile.get("aws_access_key_id") and profile.get("aws_secret_access_key"):
            settings.update({key: profile[key] for key in KEYS if profile.get(key)})
        elif any(profile.get(way) for way in RUN_BY_THE_SDK):
            way = next(way for way in RUN_BY_THE_SDK if profile.get(way))
            name = named or "default"
            raise RemoteDataError(
                f"AWS profile {name} gets its credentials through {way}, which only the AWS CLI or an SDK runs: "
                f"export them for the job first: eval \"$(aws configure export-credentials --profile {name} --format env)\"")
    return settings


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
