"""Bad object-store input and output fail before any worker starts: one line naming the URL and the fix, exit 3.

The answers are a real S3 API's: moto's server with signatures and IAM policies enforced, in a process of
its own (moto's auth switch is process-wide, and the session's `s3_server` serves without auth). Its users
hold real access keys and policies; "no credentials" is botocore's own answer when none are found, a
refused key and a missing permission are the server's. Inputs go through the real CLI: in a subprocess where the
process environment is the case (no credentials anywhere, credentials from AWS_*, an endpoint that
retries), else in process; either way stderr holds exactly one `error:` line, no traceback and never
the secret, and no worker started (the subprocess's Ray never made its temp dir; in process, the
driver's connect fails the test). Output URLs are not accepted by the job schema yet, so the output checks run through
`preflight` on a job whose output.path is a URL.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from typer.testing import CliRunner

from embedpipe.cli import app
from embedpipe.config import parse_job
from embedpipe.errors import StorageError
from embedpipe.io import fs
from embedpipe.preflight import preflight
from tests.conftest import free_port, write_job
from tests.test_exit_codes import _one_line

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

MODEL = "sentence-transformers/all-MiniLM-L6-v2"
BUCKET = "corpus"  # holds data/corpus.parquet
OUT_BUCKET = "outputs"  # empty
CORPUS = f"s3://{BUCKET}/data/corpus.parquet"
# user -> the S3 actions its IAM policy allows
USERS = {
    "admin": ["s3:*"],
    "nobody": [],
    "lister": ["s3:ListBucket"],
    "reader": ["s3:ListBucket", "s3:GetObject"],
    "no-delete": ["s3:ListBucket", "s3:GetObject", "s3:PutObject"],
    "no-put": ["s3:ListBucket", "s3:GetObject", "s3:DeleteObject"],
}


@dataclasses.dataclass(frozen=True)
class AuthS3:
    endpoint: str
    keys: dict[str, dict[str, str]]  # user -> {"key": ..., "secret": ...}

    def options(self, user: str) -> dict:
        """The job's storage_options for this user: the endpoint and the user's key and secret."""
        return {"endpoint_url": self.endpoint, **self.keys[user]}

    def listing(self, bucket: str) -> list[str]:
        import s3fs

        return s3fs.S3FileSystem(**self.options("admin"), skip_instance_cache=True).find(bucket)


@pytest.fixture(scope="module")
def auth_s3(tmp_path_factory, quickstart_table):
    """moto's S3 and IAM on 127.0.0.1, set up unauthenticated, then enforcing signatures and policies."""
    import boto3
    import requests

    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                requests.get(f"{endpoint}/moto-api/", timeout=1)
                break
            except requests.ConnectionError:
                assert time.monotonic() < deadline and server.poll() is None, "moto's server did not start"
                time.sleep(0.1)
        setup = {"endpoint_url": endpoint, "region_name": "us-east-1", "aws_access_key_id": "setup",
                 "aws_secret_access_key": "setup"}
        iam, s3 = boto3.client("iam", **setup), boto3.client("s3", **setup)
        corpus = tmp_path_factory.mktemp("auth_s3") / "corpus.parquet"
        pq.write_table(quickstart_table.slice(0, 200), corpus)
        for bucket in (BUCKET, OUT_BUCKET):
            s3.create_bucket(Bucket=bucket)
        s3.upload_file(str(corpus), BUCKET, "data/corpus.parquet")
        keys = {}
        for user, actions in USERS.items():
            iam.create_user(UserName=user)
            if actions:
                policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": actions,
                                                                  "Resource": "*"}]}
                iam.put_user_policy(UserName=user, PolicyName="s3", PolicyDocument=json.dumps(policy))
            key = iam.create_access_key(UserName=user)["AccessKey"]
            keys[user] = {"key": key["AccessKeyId"], "secret": key["SecretAccessKey"]}
        # from now on every request is checked: its signature against the IAM keys, its action against the policy
        requests.post(f"{endpoint}/moto-api/reset-auth", data=b"0", timeout=10).raise_for_status()
        _check_aws_actions(endpoint, keys["lister"])
        yield AuthS3(endpoint=endpoint, keys=keys)
    finally:
        server.terminate()
        server.wait(timeout=30)


def _check_aws_actions(endpoint: str, lister: dict[str, str]) -> None:
    """The server authorizes as AWS does: a LIST (ListObjectsV2) needs s3:ListBucket, which "lister" holds.
    moto 5.2.6 asks for s3:ListObjectsV2 instead; every policy case here would then be judged by that rule."""
    import boto3
    import botocore.exceptions
    import moto

    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id=lister["key"],
                          aws_secret_access_key=lister["secret"])
    try:
        client.list_objects_v2(Bucket=BUCKET, MaxKeys=1)
    except botocore.exceptions.ClientError as exc:
        pytest.fail(f"moto {moto.__version__} refused ListObjectsV2 to a user holding s3:ListBucket ({exc}), which "
                    f"is all AWS asks for it: exclude this moto in pyproject.toml's dev extra, as 5.2.6 is, and run "
                    f"bash scripts/setup.sh")


@pytest.fixture
def clean_env(tmp_path) -> dict:
    """An environment with no AWS credentials anywhere (variables, ~/.aws, instance metadata), one attempt per
    request, and Ray's temp dir in tmp_path (a started Ray makes ``ray/`` there)."""
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(HOME=str(home), AWS_CONFIG_FILE=str(home / "none"), AWS_SHARED_CREDENTIALS_FILE=str(home / "none"),
               AWS_EC2_METADATA_DISABLED="true", AWS_MAX_ATTEMPTS="1", AWS_RETRY_MODE="standard",
               RAY_TMPDIR=str(tmp_path / "raytmp"))
    return env


def _input_job(tmp_path: Path, path: str, options: dict) -> Path:
    return write_job(tmp_path / "job.yaml", input={"path": path, "storage_options": options}, model={"path": MODEL},
                     output={"path": str(tmp_path / "out")}, cluster={"workers": 1, "cpus_per_worker": 1})


def _no_secret(text: str, options: dict) -> None:
    for secret in (options.get("secret"), options.get("key")):
        assert not secret or secret not in text


def _run_input(tmp_path: Path, env: dict, path: str, options: dict) -> str:
    """`embedpipe run` on an input URL in a fresh process with ``env``: exit 3 with one `error:` line for it, no
    worker started (Ray never made its temp dir), no secret printed; the line."""
    job = _input_job(tmp_path, path, options)
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "embedpipe.cli", "run", str(job), "--no-progress"],
                            capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parents[1],
                            env={**env, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert result.returncode == 3, result.stderr
    line = _one_line(result.stderr, f"error: {path}: ")
    assert not (tmp_path / "raytmp").exists(), "Ray was started for a bad input"
    assert not (tmp_path / "out").exists()
    _no_secret(result.stderr + result.stdout, options)
    assert time.monotonic() - started < 60
    return line


@pytest.fixture
def cli_input(tmp_path, monkeypatch):
    """`embedpipe run` on an input URL in this process (the environment does not matter to the case): exit 3
    with one `error:` line for it, Ray never started, no secret printed; the line."""
    import embedpipe.cluster.driver as driver

    monkeypatch.setattr(driver, "connect", lambda cfg: pytest.fail("Ray was started for a bad input"))

    def run(path: str, options: dict) -> str:
        result = CliRunner().invoke(app, ["run", str(_input_job(tmp_path, path, options)), "--no-progress"])
        assert result.exit_code == 3 and isinstance(result.exception, SystemExit), result.output
        line = _one_line(result.stderr, f"error: {path}: ")
        _no_secret(result.output, options)
        assert not (tmp_path / "out").exists()
        return line
    return run


# --------------------------------------------------------------------------- input.path, through the CLI

def test_input_endpoint_unreachable_names_the_storage_option(tmp_path, clean_env, auth_s3):
    endpoint = f"http://127.0.0.1:{free_port()}"
    line = _run_input(tmp_path, clean_env, CORPUS, {**auth_s3.options("reader"), "endpoint_url": endpoint})
    assert f"cannot reach the store at {endpoint}, set by input.storage_options.endpoint_url" in line
    assert "AWS_ENDPOINT_URL" in line


def test_input_bucket_missing(cli_input, auth_s3):
    line = cli_input("s3://no-such-bucket/data/corpus.parquet", auth_s3.options("reader"))
    assert f"bucket 'no-such-bucket' does not exist at {auth_s3.endpoint}" in line and "NoSuchBucket" in line
    assert "fix the bucket name in input.path" in line


def test_input_no_credentials(tmp_path, clean_env, auth_s3):
    line = _run_input(tmp_path, clean_env, CORPUS, {"endpoint_url": auth_s3.endpoint})
    assert "no credentials for s3://corpus (Unable to locate credentials)" in line
    assert "set input.storage_options key and secret (or profile), or AWS_ACCESS_KEY_ID" in line


def test_input_credentials_refused(cli_input, auth_s3):
    options = {"endpoint_url": auth_s3.endpoint, "key": "AKIAEMBEDPIPEUNKNOWN", "secret": "not-a-real-secret-9f3e"}
    line = cli_input(CORPUS, options)
    assert "the store refused the credentials (from input.storage_options)" in line and "InvalidAccessKeyId" in line
    assert "correct input.storage_options key and secret" in line


def test_input_wrong_secret_is_refused_and_never_printed(cli_input, auth_s3):
    options = {**auth_s3.options("reader"), "secret": auth_s3.keys["reader"]["secret"][::-1]}
    line = cli_input(CORPUS, options)
    assert "refused the credentials" in line and "SignatureDoesNotMatch" in line


def test_input_credentials_from_the_environment(tmp_path, clean_env, auth_s3):
    env = {**clean_env, "AWS_ACCESS_KEY_ID": "AKIAEMBEDPIPEUNKNOWN", "AWS_SECRET_ACCESS_KEY": "env-secret-7c1d"}
    line = _run_input(tmp_path, env, CORPUS, {"endpoint_url": auth_s3.endpoint})
    assert "the store refused the credentials (from AWS_ACCESS_KEY_ID)" in line
    assert "env-secret-7c1d" not in line and "AKIAEMBEDPIPEUNKNOWN" not in line


def test_input_may_not_list(cli_input, auth_s3):
    line = cli_input(CORPUS, auth_s3.options("nobody"))
    assert "access denied" in line and "AccessDenied" in line
    assert "grant s3:ListBucket on arn:aws:s3:::corpus to these credentials (input.path needs s3:ListBucket, " \
           "s3:GetObject)" in line


def test_input_may_list_but_not_read(cli_input, auth_s3):
    line = cli_input(CORPUS, auth_s3.options("lister"))
    assert "access denied" in line
    assert "grant s3:GetObject on arn:aws:s3:::corpus/data/corpus.parquet*" in line


# --------------------------------------------------------------------------- output.path, through preflight

@pytest.fixture
def output_job(tmp_path, small_corpus):
    """A job on a local input whose output.path is set to a URL as preflight would get it once the schema
    accepts output URLs (today OutputConfig.validate refuses them)."""
    _, corpus = small_corpus
    job = parse_job({"input": {"path": str(corpus)}, "model": {"path": MODEL},
                     "output": {"path": str(tmp_path / "out")}})

    def make(url: str, options: dict):
        import s3fs

        s3fs.S3FileSystem.clear_instance_cache()
        return dataclasses.replace(job, output=dataclasses.replace(job.output, path=url, storage_options=options))
    return make


def _refused(job) -> str:
    with pytest.raises(StorageError) as info:
        preflight(job)
    line = info.value.line()
    assert line.startswith(f"{job.output.path}: ") and info.value.exit_code == 3
    for secret in (job.output.storage_options.get("secret"), job.output.storage_options.get("key")):
        assert not secret or secret not in line
    return line


OUT = f"s3://{OUT_BUCKET}/embeddings/run"


def test_output_bucket_missing(output_job, auth_s3):
    line = _refused(output_job("s3://no-such-bucket/out", auth_s3.options("admin")))
    assert f"bucket 'no-such-bucket' does not exist at {auth_s3.endpoint}" in line
    assert "fix the bucket name in output.path" in line


def test_output_endpoint_unreachable(output_job, auth_s3, monkeypatch):
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    endpoint = f"http://127.0.0.1:{free_port()}"
    line = _refused(output_job(OUT, {**auth_s3.options("admin"), "endpoint_url": endpoint}))
    assert f"cannot reach the store at {endpoint}, set by output.storage_options.endpoint_url" in line


def test_output_no_credentials(output_job, auth_s3, monkeypatch, tmp_path):
    for name in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    line = _refused(output_job(OUT, {"endpoint_url": auth_s3.endpoint}))
    assert "no credentials for s3://outputs" in line and "set output.storage_options key and secret" in line


def test_output_credentials_refused(output_job, auth_s3):
    line = _refused(output_job(OUT, {**auth_s3.options("admin"), "secret": "wrong-secret-for-admin"}))
    assert "the store refused the credentials (from output.storage_options)" in line and "SignatureDoesNotMatch" in line


@pytest.mark.parametrize("user, missing", [("nobody", "s3:ListBucket"), ("reader", "s3:DeleteObject"),
                                           ("no-delete", "s3:DeleteObject"), ("no-put", "s3:PutObject")])
def test_output_missing_permission_is_named_and_nothing_is_left(output_job, auth_s3, user, missing):
    line = _refused(output_job(OUT, auth_s3.options(user)))
    resource = "arn:aws:s3:::outputs" + ("" if missing == "s3:ListBucket" else "/embeddings/run/*")
    assert "access denied" in line and f"grant {missing} on {resource} to these credentials" in line
    assert "output.path needs s3:ListBucket, s3:GetObject, s3:PutObject, s3:DeleteObject" in line
    assert auth_s3.listing(OUT_BUCKET) == []


def test_output_writable_passes_and_leaves_nothing(output_job, auth_s3):
    plan = preflight(output_job(OUT, auth_s3.options("admin")))
    assert plan.rows == 300
    assert auth_s3.listing(OUT_BUCKET) == []


def test_output_without_its_fsspec_backend(output_job):
    try:
        import gcsfs  # noqa: F401
        pytest.skip("gcsfs is installed here: gs:// has its backend")
    except ImportError:
        pass
    line = _refused(output_job("gs://bucket/out", {}))
    assert "no fsspec package for gs:// is installed" in line and "pip install gcsfs" in line



# --------------------------------------------------------------------------- secrets

def test_an_error_line_never_holds_a_secret(monkeypatch):
    """Whatever a backend puts in its message: the job's secret options, AWS_* secrets and a URL's password
    are replaced before the line is made (the public options, such as the endpoint, stay)."""
    monkeypatch.setenv("AWS_SESSION_TOKEN", "env-session-token-5d2a")
    fs.use_storage_options("s3://scrubbed", {"endpoint_url": "http://store:9000", "secret": "job-secret-81f0",
                                             "client_kwargs": {"aws_session_token": "job-token-3b7c"}})
    said = ("denied for job-secret-81f0 with job-token-3b7c and env-session-token-5d2a at "
            "http://user:url-password@store:9000/scrubbed")
    with pytest.raises(StorageError) as info, fs.remote_errors("s3://scrubbed/x.parquet"):
        raise PermissionError(said)
    line = info.value.line()
    for secret in ("job-secret-81f0", "job-token-3b7c", "env-session-token-5d2a", "url-password"):
        assert secret not in line
    assert line.startswith("s3://scrubbed/x.parquet: access denied") and "<redacted>" in line
