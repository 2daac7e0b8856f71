"""Real servers on 127.0.0.1 only, for the object-storage tests and the remote loader
benchmark: nginx serving a folder over HTTP or HTTPS (range requests answered with 206, an
access log to count requests, a `deny all;` location) and moto's S3 server.

As a command, a folder served by nginx while another command runs (tools/gpu_check.py's
e2e-remote stage: training fed over HTTP beside the same from local disk):

    python benchmarks/loopback_servers.py --serve FOLDER -- COMMAND ...   ({url} in COMMAND: the server's)
"""
from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_listening(port: int, process: subprocess.Popen) -> None:
    for _ in range(500):
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.02)   # polling for the port to open, not a timing assumption
    raise RuntimeError(f"nothing listening on 127.0.0.1:{port}")


ECHO_MODULE = Path("/usr/lib/nginx/modules/ngx_http_echo_module.so")   # Debian's libnginx-mod-http-echo


class Nginx:
    """nginx serving `root` on 127.0.0.1; over HTTPS with `tls` = (certificate, key) files; each
    answer `delay_ms` late with `delay_ms` (nginx's echo module sleeps, then serves the file as
    usual: a far store's round trip that costs this machine no CPU, where a proxy's copies do); to
    the one `basic_auth` = (user, password) only, where given."""

    def __init__(self, root: Path, prefix: Path, port: int | None = None, tls: tuple[Path, Path] | None = None,
                 delay_ms: float = 0, basic_auth: tuple[str, str] | None = None):
        self.port = port or free_port()      # a port of its own, or that of a server stopped before
        prefix.mkdir(parents=True, exist_ok=True)
        self.access_log = prefix / "access.log"
        conf = prefix / "nginx.conf"
        # As root, nginx's workers drop to `nobody`, which cannot enter pytest's 0700 folders.
        user = "user root;" if os.geteuid() == 0 else ""
        delay = ""
        if delay_ms:
            if not ECHO_MODULE.exists():
                raise RuntimeError(f"a delay in nginx needs its echo module ({ECHO_MODULE}): "
                                   "apt-get install libnginx-mod-http-echo")
            delay = f"location / {{ echo_sleep {delay_ms / 1000:g}; echo_exec @stored; }} location @stored {{ }}"
        auth = ""
        if basic_auth:
            (prefix / "htpasswd").write_text(f"{basic_auth[0]}:{{PLAIN}}{basic_auth[1]}\n")
            auth = f'auth_basic "datasets"; auth_basic_user_file {prefix}/htpasswd;'
        conf.write_text(f"""{f"load_module {ECHO_MODULE};" if delay_ms else ""}
daemon off; {user} pid {prefix}/nginx.pid; error_log {prefix}/error.log;
events {{ worker_connections 256; }}
http {{
  access_log {self.access_log}; sendfile on; tcp_nopush on;
  client_body_temp_path {prefix}/body; proxy_temp_path {prefix}/proxy; fastcgi_temp_path {prefix}/fcgi;
  uwsgi_temp_path {prefix}/uwsgi; scgi_temp_path {prefix}/scgi;
  server {{ listen 127.0.0.1:{self.port}{" ssl" if tls else ""}; root {Path(root).resolve()}; {auth} location /denied/ {{ deny all; }} {delay}
           {f"ssl_certificate {tls[0]}; ssl_certificate_key {tls[1]};" if tls else ""} }}
}}""")
        # -e: the log of its start too, which is otherwise the build's path (/var/log/nginx)
        self.process = subprocess.Popen(["nginx", "-c", str(conf), "-p", str(prefix), "-e", str(prefix / "error.log")])
        wait_listening(self.port, self.process)
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"

    def requests(self) -> int:
        return len(self.access_log.read_text().splitlines()) if self.access_log.exists() else 0

    def stop(self):
        self.process.terminate()
        self.process.wait()


class MotoS3:
    def __init__(self):
        import logging
        from moto.server import ThreadedMotoServer
        logging.getLogger("werkzeug").setLevel(logging.ERROR)    # a line per request otherwise
        self.port = free_port()
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port)
        self.server.start()
        self.url = f"http://127.0.0.1:{self.port}"

    def upload(self, folder: Path, bucket: str, prefix: str) -> str:
        """Every file under `folder` as s3://bucket/prefix/<its path>; returns that URL."""
        import boto3    # obstore has no bucket creation; boto3 comes with moto
        client = boto3.client("s3", endpoint_url=self.url, region_name="us-east-1", aws_access_key_id="testing",
                              aws_secret_access_key="testing")
        if bucket not in [b["Name"] for b in client.list_buckets().get("Buckets", [])]:
            client.create_bucket(Bucket=bucket)
        for path in sorted(folder.rglob("*")):
            if path.is_file():
                client.upload_file(str(path), bucket, f"{prefix}/{path.relative_to(folder)}")
        return f"s3://{bucket}/{prefix}"

    def environment(self) -> dict[str, str]:
        """The variables that point an S3 client at this server."""
        return {"AWS_ENDPOINT_URL": self.url, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                "AWS_REGION": "us-east-1"}

    def stop(self):
        self.server.stop()


def serve_while(folder: Path, command: list[str]) -> int:
    """COMMAND's exit status, run while nginx serves FOLDER, with each {url} in it the server's."""
    if not folder.is_dir():
        print(f"error: {folder} is not a folder", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="nginx-") as prefix:
        server = Nginx(folder.resolve(), Path(prefix))
        try:
            print(f"[loopback] nginx serves {folder} at {server.url}", file=sys.stderr, flush=True)
            status = subprocess.run([part.replace("{url}", server.url) for part in command]).returncode
            print(f"[loopback] nginx answered {server.requests():,} requests", file=sys.stderr, flush=True)
            return status
        finally:
            server.stop()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--serve", type=Path, required=True, metavar="FOLDER", help="the folder nginx serves")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run while it does")
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    return serve_while(args.serve, command)


if __name__ == "__main__":
    sys.exit(main())
