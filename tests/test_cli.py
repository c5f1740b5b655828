"""The `whistle-stream` command: info, download, transcribe, serve, and its error exits."""

import hashlib
import json
import subprocess
import sys
import types

import pytest

from harness.blocked import run_without

import whistle_stream
from whistle_stream import cli, models
from whistle_stream.errors import ExitStatus
from whistle_stream.results import Transcription, Word


@pytest.fixture
def env(tmp_path, monkeypatch):
    monkeypatch.delenv(models.ENV_MODEL, raising=False)
    monkeypatch.setenv(models.ENV_CACHE, str(tmp_path / "cache"))
    monkeypatch.setattr(models, "demo_model_path", lambda: None)
    monkeypatch.setattr(models, "demo_manifest_path", lambda: None)
    return tmp_path


@pytest.fixture
def tiny_cact(tiny_model):
    """The .cact of the harness's "tiny" reference model (conftest builds it once)."""
    return tiny_model.path


def run(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code, err, *fragments, status=ExitStatus.USAGE):
    assert code == status
    assert err.count("\n") == 1 and err.startswith("whistle-stream: error: ")
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in err


# ---------------------------------------------------------------------------------------------
# info

def test_info_prints_dims_languages_records_sizes_and_sha(env, tiny_cact, capsys):
    from whistle_stream.container import CactFile

    code, out, err = run(capsys, "info", str(tiny_cact))
    assert code == 0 and err == ""
    with CactFile(tiny_cact) as cact:
        dims, records, by_kind = cact.dims, len(cact.records), cact.bytes_by_kind()
    assert hashlib.sha256(tiny_cact.read_bytes()).hexdigest() in out
    assert f"records    {records}\n" in out
    assert f"languages  {', '.join(dims.languages)}\n" in out
    for kind, size in by_kind.items():
        assert f"{kind} {size:,} B" in out
    assert f"  width              {dims.width}\n" in out
    assert f"  vocab              {dims.vocab}\n" in out
    assert "custom model" in out


def test_info_json_holds_the_same_facts(env, tiny_cact, capsys):
    from whistle_stream.container import CactFile

    code, out, _ = run(capsys, "info", str(tiny_cact), "--json")
    info = json.loads(out)
    with CactFile(tiny_cact) as cact:
        assert info["records"] == len(cact.records)
        assert info["dims"]["text_vocab"] == cact.dims.text_vocab
        assert info["bytes_by_dtype"] == cact.bytes_by_kind()
    assert info["size"] == tiny_cact.stat().st_size
    assert sum(info["bytes_by_dtype"].values()) < info["size"]  # header, directory and padding are the rest
    assert info["resolved_as"] == "explicit"


def test_info_without_a_path_uses_the_resolved_model(env, tiny_cact, capsys, monkeypatch):
    monkeypatch.setenv(models.ENV_MODEL, str(tiny_cact))
    code, out, _ = run(capsys, "info", "--json")
    assert code == 0
    assert json.loads(out)["resolved_as"] == "env"


def test_info_names_the_demo_model_by_its_manifest_sha(env, tiny_cact, capsys, monkeypatch):
    manifest = env / "demo.json"
    manifest.write_text(json.dumps({"sha256": hashlib.sha256(tiny_cact.read_bytes()).hexdigest()}))
    monkeypatch.setattr(models, "demo_manifest_path", lambda: manifest)
    code, out, _ = run(capsys, "info", str(tiny_cact))
    assert code == 0 and "demo model" in out


def test_info_names_the_published_full_model_by_its_sha(env, tiny_cact, capsys, monkeypatch):
    monkeypatch.setattr(models, "MODEL_SHA256", hashlib.sha256(tiny_cact.read_bytes()).hexdigest())
    code, out, _ = run(capsys, "info", str(tiny_cact))
    assert code == 0 and "full model" in out


def test_info_on_a_non_cact_file_is_one_error_line(env, capsys):
    junk = env / "junk.cact"
    junk.write_bytes(b"RIFF" + bytes(300))
    code, _, err = run(capsys, "info", str(junk))
    assert_one_line_error(code, err, "junk.cact", "not a .cact model")


def test_info_on_a_missing_file_is_one_error_line(env, capsys):
    code, _, err = run(capsys, "info", str(env / "missing.cact"))
    assert_one_line_error(code, err, "missing.cact does not exist")


def test_info_with_no_model_anywhere_says_how_to_get_one(env, capsys):
    code, _, err = run(capsys, "info")
    assert_one_line_error(code, err, "whistle-stream download", models.MODEL_URL)


# ---------------------------------------------------------------------------------------------
# download

def fake_hub(payload=None, error=None):
    def download(*, progress, repo_id, filename, local_dir):
        if error is not None:
            raise error
        path = local_dir / filename
        path.write_bytes(payload)
        return str(path)
    return download


def test_download_caches_and_prints_the_path(env, capsys, monkeypatch):
    payload = b"model bytes" * 100
    monkeypatch.setattr(models, "MODEL_SIZE", len(payload))
    monkeypatch.setattr(models, "MODEL_SHA256", hashlib.sha256(payload).hexdigest())
    monkeypatch.setattr(models, "_hf_hub_download", fake_hub(payload))
    code, out, _ = run(capsys, "download", "--quiet")
    assert code == 0
    assert out.strip() == str(models.cached_model_path())
    assert models.cached_model_path().read_bytes() == payload


def test_download_of_a_wrong_file_exits_failed(env, capsys, monkeypatch):
    monkeypatch.setattr(models, "_hf_hub_download", fake_hub(b"not the model"))
    code, _, err = run(capsys, "download", "--force")
    assert_one_line_error(code, err, "refused", status=ExitStatus.FAILED)
    assert not models.cached_model_path().exists()


def test_download_offline_exits_failed_with_manual_instructions(env, capsys, monkeypatch):
    monkeypatch.setattr(models, "_hf_hub_download", fake_hub(error=OSError("network is unreachable")))
    code, _, err = run(capsys, "download")
    assert_one_line_error(code, err, models.MODEL_URL, str(models.cached_model_path()), "network is unreachable",
                          status=ExitStatus.FAILED)


# ---------------------------------------------------------------------------------------------
# transcribe

class FakeWhistle:
    """Records how the CLI drives `Whistle`; returns a fixed-shape result."""
    instances = []

    def __init__(self, path):
        self.path, self.calls = path, []
        FakeWhistle.instances.append(self)

    def transcribe(self, audio, **options):
        self.calls.append((audio, options))
        return Transcription("hello world", "en", 12.0, 50.0,
                             (Word("hello", 0.0, 0.4, 0.9), Word("world", 0.48, 0.96, 0.8)))


@pytest.fixture
def fake_whistle(env, monkeypatch):
    FakeWhistle.instances = []
    monkeypatch.setattr(whistle_stream, "Whistle", FakeWhistle, raising=False)
    model = env / "m.cact"
    model.write_bytes(b"x")
    audio = env / "clip.wav"
    audio.write_bytes(b"RIFF")
    return model, audio


def test_transcribe_passes_options_and_prints_text(fake_whistle, capsys):
    model, audio = fake_whistle
    code, out, _ = run(capsys, "transcribe", str(audio), "--model", str(model), "--language", "de",
                       "--keyword", "Cactus", "--keyword", "Whistle", "--beams", "3")
    assert code == 0
    assert out == "hello world\n"
    (whistle,) = FakeWhistle.instances
    assert whistle.path == model
    assert whistle.calls == [(str(audio), {"language": "de", "keywords": ["Cactus", "Whistle"], "by": "utterances",
                                           "word_timestamps": False, "beams": 3, "progress": None})]


def test_transcribe_word_timestamps_prints_a_line_per_word(fake_whistle, capsys):
    model, audio = fake_whistle
    code, out, _ = run(capsys, "transcribe", str(audio), "--model", str(model), "--word-timestamps")
    lines = out.splitlines()
    assert code == 0 and lines[0] == "hello world"
    assert lines[1].endswith("] hello") and "0.40" in lines[1]
    assert lines[2].endswith("] world") and "0.48" in lines[2]
    assert FakeWhistle.instances[0].calls[0][1] == {"language": None, "keywords": None, "by": "utterances",
                                                    "word_timestamps": True, "progress": None}


def test_transcribe_json_prints_the_whole_result(fake_whistle, capsys):
    model, audio = fake_whistle
    code, out, _ = run(capsys, "transcribe", str(audio), "--model", str(model), "--json")
    assert code == 0
    assert json.loads(out) == FakeWhistle(model).transcribe(audio).to_dict()


@pytest.mark.parametrize("fmt", ["srt", "vtt"])
def test_transcribe_writes_subtitles_that_parse(fake_whistle, capsys, fmt):
    import io

    import srt
    import webvtt

    model, audio = fake_whistle
    code, out, _ = run(capsys, "transcribe", str(audio), "--model", str(model), "--format", fmt)
    assert code == 0 and FakeWhistle.instances[0].calls[0][1]["word_timestamps"] is True
    if fmt == "srt":
        (cue,) = srt.parse(out)
        assert (cue.content, cue.start.total_seconds(), cue.end.total_seconds()) == ("hello world", 0.0, 0.96)
    else:
        (cue,) = webvtt.from_buffer(io.StringIO(out))
        assert (cue.text, cue.start, cue.end) == ("hello world", "00:00:00.000", "00:00:00.960")


def test_transcribe_several_files_into_a_folder_and_to_stdout(fake_whistle, capsys, env):
    model, audio = fake_whistle
    other = env / "other.wav"
    other.write_bytes(b"RIFF")
    code, out, _ = run(capsys, "transcribe", str(audio), str(other), "--model", str(model), "--format", "srt",
                       "--output-dir", str(env / "subs"))
    assert code == 0 and out.split() == [str(env / "subs" / "clip.srt"), str(env / "subs" / "other.srt")]
    assert (env / "subs" / "other.srt").read_text().startswith("1\n00:00:00,000 --> ")
    code, out, _ = run(capsys, "transcribe", str(audio), str(other), "--model", str(model))
    assert code == 0 and out == f"==> {audio} <==\nhello world\n==> {other} <==\nhello world\n"
    code, out, _ = run(capsys, "transcribe", str(audio), str(other), "--model", str(model), "--format", "json")
    assert [json.loads(line)["file"] for line in out.splitlines()] == [str(audio), str(other)]


def test_subtitles_of_several_files_need_a_folder(fake_whistle, capsys, env):
    model, audio = fake_whistle
    code, _, err = run(capsys, "transcribe", str(audio), str(audio), "--model", str(model), "--format", "vtt")
    assert_one_line_error(code, err, "--output-dir")


def test_the_progress_bar_follows_the_engine_when_stderr_is_a_terminal(fake_whistle, capsys, monkeypatch):
    seen = []

    def transcribe(self, audio, progress=None, **options):
        seen.append(progress)
        if progress is not None:
            progress(5.0, 10.0)
            progress(10.0, 10.0)
        return Transcription("hi", "en", 0.0, 0.0, ())

    monkeypatch.setattr(FakeWhistle, "transcribe", transcribe)
    model, audio = fake_whistle
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    code, out, err = run(capsys, "transcribe", str(audio), "--model", str(model))
    assert code == 0 and out == "hi\n" and seen[-1] is not None and "clip.wav" in err
    code, out, err = run(capsys, "transcribe", str(audio), "--model", str(model), "--no-progress")
    assert seen[-1] is None and err == ""


def test_transcribe_a_missing_audio_file_exits_2(fake_whistle, capsys):
    model, _ = fake_whistle
    code, _, err = run(capsys, "transcribe", "nowhere.wav", "--model", str(model))
    assert_one_line_error(code, err, "nowhere.wav")


def test_transcribe_engine_errors_exit_2_without_traceback(fake_whistle, capsys, monkeypatch):
    from whistle_stream.errors import AudioError

    def broken(self, audio, **options):
        raise AudioError("clip.wav: sample rate 8000 Hz; accepted: any rate, resampled to 16000 Hz")
    monkeypatch.setattr(FakeWhistle, "transcribe", broken)
    model, audio = fake_whistle
    code, _, err = run(capsys, "transcribe", str(audio), "--model", str(model))
    assert_one_line_error(code, err, "sample rate 8000 Hz")


def test_transcribe_an_option_the_engine_refuses_exits_2(fake_whistle, capsys, monkeypatch):
    def refuse(self, audio, **options):
        raise ValueError("unknown language 'xx'; this model knows en, de")
    monkeypatch.setattr(FakeWhistle, "transcribe", refuse)
    model, audio = fake_whistle
    code, _, err = run(capsys, "transcribe", str(audio), "--model", str(model), "--language", "xx")
    assert_one_line_error(code, err, "unknown language 'xx'")


@pytest.mark.slow
def test_transcribe_runs_the_engine_end_to_end(env, tiny_cact, capsys):
    """The real Whistle on a random tiny model: the text is noise, but the pipeline and JSON are real."""
    import wave

    import numpy as np

    from whistle_stream.container import CactFile

    rng = np.random.default_rng(0)
    t = np.arange(2 * 16000) / 16000
    pcm = 0.3 * np.sin(2 * np.pi * 440 * t) * (1 + np.sin(2 * np.pi * 3 * t)) + 0.01 * rng.standard_normal(t.size)
    clip = env / "tone.wav"
    with wave.open(str(clip), "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(16000)
        w.writeframes((pcm * 32767).astype("<i2").tobytes())
    code, out, err = run(capsys, "transcribe", str(clip), "--model", str(tiny_cact), "--json", "--beams", "2")
    assert code == 0, err
    result = json.loads(out)
    with CactFile(tiny_cact) as cact:
        assert result["language"] in cact.dims.languages
    assert isinstance(result["text"], str)


@pytest.mark.parametrize("beams", ["0", "-2", "five"])
def test_transcribe_rejects_a_bad_beam_count(fake_whistle, capsys, beams):
    _, audio = fake_whistle
    with pytest.raises(SystemExit) as info:
        cli.main(["transcribe", str(audio), "--beams", beams])
    assert info.value.code == 2
    assert "positive integer" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# serve, version, the console script

def test_serve_delegates_its_arguments_to_the_service_with_the_captions_page(monkeypatch):
    from whistle_stream import service
    from whistle_stream.clients import WEB_ROOT

    seen = []
    server = types.ModuleType("whistle_stream.service.server")
    server.main = lambda argv, web_root=None: seen.append((argv, web_root)) or 0
    monkeypatch.setitem(sys.modules, "whistle_stream.service.server", server)
    monkeypatch.setattr(service, "server", server, raising=False)
    assert cli.main(["serve", "--port", "9000", "--help"]) == 0
    assert seen == [(["--port", "9000", "--help"], WEB_ROOT)]
    assert (WEB_ROOT / "index.html").is_file()


def test_serve_without_the_server_extra_names_the_missing_package():
    done = run_without(["websockets"], """
        import sys
        from whistle_stream import cli
        sys.exit(cli.main(["serve"]))
    """)
    assert done.returncode == 2, done.stderr
    assert "'websockets'" in done.stderr and "whistle-stream[server]" in done.stderr


def test_version_prints_the_package_version(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip().startswith("whistle-stream ")


def test_no_command_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main([])
    assert info.value.code == 2


def test_console_script_error_is_one_line_and_exit_2(tmp_path):
    result = subprocess.run([sys.executable, "-m", "whistle_stream.cli", "info", str(tmp_path / "none.cact")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "none.cact does not exist" in result.stderr
