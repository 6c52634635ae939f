//! Real vLLM servers for the worker's engine tests: the shared one (one
//! server for every test that only attaches to it, started by the first of
//! them and reused by the others; `scripts/test` stops it at the end), and
//! launch commands for tests whose worker starts its own.
//!
//! The server comes from `.venv-vllm` (`scripts/setup --vllm` or `scripts/test` installs it). A test
//! that needs it and cannot start it fails: these tests never skip.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use asyncrl_config::ModelConfig;
use asyncrl_policy::Policy;

/// How long a vLLM server may take to answer /health (51 s on a quiet
/// 2-core machine with --enforce-eager; much more beside a build).
pub const START_LIMIT: Duration = Duration::from_secs(540);
/// `--max-model-len` of every test server.
pub const MAX_MODEL_LEN: usize = 256;

/// The python of `.venv-vllm` (or `$ASYNCRL_VLLM_PYTHON`).
pub fn python() -> PathBuf {
    if let Some(p) = std::env::var_os("ASYNCRL_VLLM_PYTHON") {
        return PathBuf::from(p);
    }
    asyncrl_testkit::workspace_root().join(".venv-vllm/bin/python")
}

/// The environment every test server runs with: dev-mode routes, and a
/// 1 GiB KV cache (vLLM's CPU default takes most of the machine's memory).
pub const ENV: &[(&str, &str)] = &[
    ("VLLM_SERVER_DEV_MODE", "1"),
    ("VLLM_CPU_KVCACHE_SPACE", "1"),
    ("VLLM_NO_USAGE_STATS", "1"),
    ("HF_HUB_OFFLINE", "1"),
    ("TOKENIZERS_PARALLELISM", "false"),
];

/// The server's arguments after the python.
pub fn server_args(model: &Path, port: u16, logprobs_mode: &str) -> Vec<String> {
    [
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        &model.to_string_lossy(),
        "--dtype",
        "float32",
        "--max-model-len",
        &MAX_MODEL_LEN.to_string(),
        "--logprobs-mode",
        logprobs_mode,
        "--enable-scale-out",
        "--enforce-eager",
        "--host",
        "127.0.0.1",
        "--port",
        &port.to_string(),
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect()
}

/// `worker.engine.launch` for a server the worker starts itself; the
/// server's pid goes to `pid_file` (so a test can kill -9 it).
pub fn launch_command(
    model: &Path,
    port: u16,
    logprobs_mode: &str,
    pid_file: &Path,
) -> Vec<String> {
    let mut inner = vec!["env".to_owned()];
    inner.extend(ENV.iter().map(|(k, v)| format!("{k}={v}")));
    inner.push(python().to_string_lossy().into_owned());
    inner.extend(server_args(model, port, logprobs_mode));
    let quoted: Vec<String> = inner.iter().map(|a| format!("'{a}'")).collect();
    vec![
        "sh".into(),
        "-c".into(),
        format!(
            "echo $$ > '{}'; exec {}",
            pid_file.display(),
            quoted.join(" ")
        ),
    ]
}

/// The pid a launch command wrote.
pub fn read_pid(pid_file: &Path) -> i32 {
    std::fs::read_to_string(pid_file)
        .expect("pid file")
        .trim()
        .parse()
        .expect("a pid")
}

/// Whether `url`/health answers 200.
pub fn healthy(url: &str) -> bool {
    let Some(addr) = url.strip_prefix("http://") else {
        return false;
    };
    let Ok(mut s) = std::net::TcpStream::connect(addr) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(3)));
    if s.write_all(format!("GET /health HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())
        .is_err()
    {
        return false;
    }
    let mut buf = [0u8; 16];
    use std::io::Read;
    matches!(s.read(&mut buf), Ok(n) if n >= 12 && &buf[9..12] == b"200")
}

fn shared_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("vllm-shared")
}

/// The shared server's model folder (the built-in architecture of
/// `section`, weights of seed 1) and its URL. Starts the server when none
/// runs; a file lock keeps two test processes from starting two.
pub fn shared(
    section: &ModelConfig,
    policy: impl Fn(&ModelConfig, u64) -> Policy,
) -> (PathBuf, String) {
    let dir = shared_dir();
    std::fs::create_dir_all(&dir).expect("shared vLLM dir");
    let lock = std::fs::File::create(dir.join("lock")).expect("lock file");
    // SAFETY: flock on a file descriptor we own.
    let rc = unsafe { libc::flock(std::os::fd::AsRawFd::as_raw_fd(&lock), libc::LOCK_EX) };
    assert_eq!(rc, 0, "flock: {}", std::io::Error::last_os_error());
    let model = dir.join("model");
    let url_file = dir.join("url");
    // The model this caller wants, to compare with the one served.
    let wanted = dir.join("wanted");
    let _ = std::fs::remove_dir_all(&wanted);
    policy(section, 1)
        .save_pretrained(&wanted, None)
        .expect("save the shared model");
    let same = |f: &str| std::fs::read(model.join(f)).ok() == std::fs::read(wanted.join(f)).ok();
    if let Ok(url) = std::fs::read_to_string(&url_file)
        && same("config.json")
        && same("model.safetensors")
        && healthy(url.trim())
    {
        return (model, url.trim().to_owned());
    }
    if let Ok(pid) = std::fs::read_to_string(dir.join("pid"))
        && let Ok(pid) = pid.trim().parse::<i32>()
    {
        // SAFETY: signals the group the previous shared server led.
        unsafe { libc::killpg(pid, libc::SIGKILL) };
    }
    let _ = std::fs::remove_dir_all(&model);
    std::fs::rename(&wanted, &model).expect("shared model folder");
    let port = asyncrl_testkit::free_port().expect("free port");
    let url = format!("http://127.0.0.1:{port}");
    let log = std::fs::File::create(dir.join("server.log")).expect("server log");
    let mut cmd = Command::new(python());
    cmd.args(server_args(&model, port, "processed_logprobs"))
        .envs(ENV.iter().copied())
        .stdin(Stdio::null())
        .stdout(log.try_clone().expect("log"))
        .stderr(log);
    std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
    // Deliberately not waited for: the shared server outlives this test
    // process (scripts/test stops it by its pid file).
    #[allow(clippy::zombie_processes)]
    let child = cmd.spawn().unwrap_or_else(|e| {
        panic!(
            "cannot start the shared vLLM server with {} ({e}); run scripts/setup --vllm",
            python().display()
        )
    });
    std::fs::write(dir.join("pid"), child.id().to_string()).expect("pid file");
    let started = Instant::now();
    while !healthy(&url) {
        assert!(
            started.elapsed() < START_LIMIT,
            "the shared vLLM server did not answer within {START_LIMIT:?}; see {}",
            dir.join("server.log").display()
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    eprintln!(
        "shared vLLM server at {url} answered after {:.0?}",
        started.elapsed()
    );
    std::fs::write(&url_file, &url).expect("url file");
    (model, url)
}
