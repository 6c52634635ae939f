//! Test and bench helpers.
//!
//! [`NatsServer`] starts a real `nats-server` with JetStream on a free port and
//! a temporary store directory, and can kill it (`SIGKILL`) and restart it on
//! the same port and store, so that tests can check what survives a crash.
//! [`NatsServer::start_with_config`] runs it with a config file (users and
//! permissions, TLS) and the files that config includes. [`NatsCluster`]
//! starts a JetStream cluster of several servers, each killable and
//! restartable alone, and finds a stream's leader.

use std::io::{BufRead, BufReader, Read};
use std::net::{TcpListener, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

#[derive(Debug, thiserror::Error)]
pub enum TestkitError {
    #[error(
        "nats-server binary not found (looked at $ASYNCRL_NATS_SERVER, {venv} and $PATH); run scripts/setup"
    )]
    NoBinary { venv: String },
    #[error("io error: {0}")]
    Io(#[from] std::io::Error),
    #[error("nats-server on port {port} did not become ready within {timeout:?}: {log}")]
    NotReady {
        port: u16,
        timeout: Duration,
        log: String,
    },
}

/// Root of the workspace this crate was built in.
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_owned)
        .unwrap_or_default()
}

/// Finds the nats-server binary: `$ASYNCRL_NATS_SERVER`, then the project's
/// venv (`.venv/bin/nats-server`, installed by scripts/setup), then `$PATH`.
pub fn nats_server_binary() -> Result<PathBuf, TestkitError> {
    if let Some(p) = std::env::var_os("ASYNCRL_NATS_SERVER") {
        return Ok(PathBuf::from(p));
    }
    let venv = workspace_root().join(".venv/bin/nats-server");
    if venv.is_file() {
        return Ok(venv);
    }
    if let Some(path) = std::env::var_os("PATH") {
        for dir in std::env::split_paths(&path) {
            let candidate = dir.join("nats-server");
            if candidate.is_file() {
                return Ok(candidate);
            }
        }
    }
    Err(TestkitError::NoBinary {
        venv: venv.display().to_string(),
    })
}

/// A port that was free a moment ago.
pub fn free_port() -> std::io::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// A nats-server configuration for [`NatsServer::start_with_config`].
#[derive(Debug, Clone, Default)]
pub struct ServerConfig {
    /// The config file's text. The port, the JetStream store and the
    /// listen address come from the command line (they win over the file;
    /// a `store_dir` in the file is an error of nats-server's).
    pub text: String,
    /// Files written next to the config file (`include`d files,
    /// certificates), by file name.
    pub files: Vec<(String, Vec<u8>)>,
    /// Environment variables of the server process (`$VAR` in the config).
    pub env: Vec<(String, String)>,
}

impl ServerConfig {
    pub fn new(text: impl Into<String>) -> Self {
        Self {
            text: text.into(),
            ..Self::default()
        }
    }

    /// Places a file next to the config file.
    pub fn file(mut self, name: impl Into<String>, contents: impl Into<Vec<u8>>) -> Self {
        self.files.push((name.into(), contents.into()));
        self
    }

    /// Sets an environment variable of the server process.
    pub fn env(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.env.push((key.into(), value.into()));
        self
    }
}

/// A real nats-server with JetStream, owned by a test. Killed on drop.
pub struct NatsServer {
    bin: PathBuf,
    port: u16,
    store: tempfile::TempDir,
    log_path: PathBuf,
    extra_args: Vec<String>,
    env: Vec<(String, String)>,
    child: Option<Child>,
}

impl NatsServer {
    /// Starts a server on a free port with a fresh store directory.
    pub fn start() -> Result<Self, TestkitError> {
        Self::start_with_args(&[])
    }

    /// Starts a server with extra command-line arguments (e.g. `--auth TOKEN`).
    pub fn start_with_args(extra: &[&str]) -> Result<Self, TestkitError> {
        let store = tempfile::Builder::new().prefix("asyncrl-nats-").tempdir()?;
        let log_path = store.path().join("nats-server.log");
        let mut server = Self {
            bin: nats_server_binary()?,
            port: free_port()?,
            store,
            log_path,
            extra_args: extra.iter().map(|s| s.to_string()).collect(),
            env: Vec::new(),
            child: None,
        };
        server.spawn()?;
        Ok(server)
    }

    /// Starts a server with a config file (written, with `config.files`,
    /// to `<store>/conf/`), on a free port with a fresh store directory.
    /// Restarts keep the config.
    pub fn start_with_config(config: &ServerConfig) -> Result<Self, TestkitError> {
        Self::start_on(free_port()?, config)
    }

    /// [`NatsServer::start_with_config`] on a given client port.
    fn start_on(port: u16, config: &ServerConfig) -> Result<Self, TestkitError> {
        let mut server = Self::prepare(port, config)?;
        server.spawn()?;
        Ok(server)
    }

    /// Writes the config and chooses the store; starts nothing.
    fn prepare(port: u16, config: &ServerConfig) -> Result<Self, TestkitError> {
        let store = tempfile::Builder::new().prefix("asyncrl-nats-").tempdir()?;
        let conf_dir = store.path().join("conf");
        std::fs::create_dir_all(&conf_dir)?;
        for (name, contents) in &config.files {
            std::fs::write(conf_dir.join(name), contents)?;
        }
        let conf = conf_dir.join("nats.conf");
        std::fs::write(&conf, &config.text)?;
        let log_path = store.path().join("nats-server.log");
        Ok(Self {
            bin: nats_server_binary()?,
            port,
            store,
            log_path,
            extra_args: vec!["-c".into(), conf.display().to_string()],
            env: config.env.clone(),
            child: None,
        })
    }

    fn spawn(&mut self) -> Result<(), TestkitError> {
        self.spawn_process()?;
        self.wait_ready(Duration::from_secs(30))
    }

    /// Starts the process; does not wait for it to answer.
    fn spawn_process(&mut self) -> Result<(), TestkitError> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log_path)?;
        let mut cmd = Command::new(&self.bin);
        cmd.args([
            "-a",
            "127.0.0.1",
            "-p",
            &self.port.to_string(),
            "-js",
            "-sd",
        ])
        .arg(self.store.path().join("jetstream"))
        .args(&self.extra_args)
        .envs(self.env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log);
        // SAFETY: prctl is async-signal-safe; it makes the server die with the
        // test process, so a crashed test leaves no server behind.
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        self.child = Some(cmd.spawn()?);
        Ok(())
    }

    /// Waits until the server accepts connections and says JetStream is on.
    fn wait_ready(&mut self, timeout: Duration) -> Result<(), TestkitError> {
        let start = Instant::now();
        while start.elapsed() < timeout {
            if let Some(child) = self.child.as_mut()
                && let Ok(Some(status)) = child.try_wait()
            {
                return Err(TestkitError::NotReady {
                    port: self.port,
                    timeout,
                    log: format!("exited with {status}: {}", self.log_tail()),
                });
            }
            if let Ok(stream) = TcpStream::connect(("127.0.0.1", self.port)) {
                stream.set_read_timeout(Some(Duration::from_secs(2)))?;
                let mut line = String::new();
                if BufReader::new(stream).read_line(&mut line).is_ok()
                    && line.contains("\"jetstream\":true")
                {
                    return Ok(());
                }
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Err(TestkitError::NotReady {
            port: self.port,
            timeout,
            log: self.log_tail(),
        })
    }

    fn log_tail(&self) -> String {
        let mut s = String::new();
        if let Ok(mut f) = std::fs::File::open(&self.log_path) {
            let _ = f.read_to_string(&mut s);
        }
        let start = s.len().saturating_sub(2000);
        s[s.floor_char_boundary(start)..].to_owned()
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// The JetStream store directory (survives kill/restart).
    pub fn store_dir(&self) -> &Path {
        self.store.path()
    }

    /// The process id of the running server (None while it is down).
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    pub fn is_running(&mut self) -> bool {
        matches!(self.child.as_mut().map(|c| c.try_wait()), Some(Ok(None)))
    }

    /// Kills the server with SIGKILL, as a crash would.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Stops the server with SIGTERM (a clean shutdown) and waits for it.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            // SAFETY: plain kill(2) on our own child's pid.
            unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
            let _ = child.wait();
        }
    }

    /// Starts the server again on the same port with the same store.
    pub fn restart(&mut self) -> Result<(), TestkitError> {
        self.kill();
        self.spawn()
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The JetStream `sync_interval` of the test cluster, the same as the
/// production cluster's (deploy/k8s/components/gpu/nats.conf; why:
/// docs/deploy.md, "NATS storage").
pub const CLUSTER_SYNC_INTERVAL: &str = "10s";

/// How a [`NatsCluster`]'s nodes are secured (default: not at all).
#[derive(Debug, Clone, Default)]
pub struct ClusterSecurity {
    /// Added to every node's config: the client side (a `tls {}` block,
    /// `authorization` with users; its files and environment).
    pub client: ServerConfig,
    /// The user and password every route authenticates with (the nodes
    /// accept routes only with them).
    pub route_auth: Option<(String, String)>,
    /// The body of the cluster's `tls {}` block (certificate, key, CA,
    /// `verify: true`): routes speak TLS to each other.
    pub route_tls: Option<String>,
}

/// A JetStream cluster of real nats-servers on loopback, owned by a test:
/// each node has its own client port, route port, monitoring port and
/// store, a `server_name` (`n0`, `n1`, ...) and routes to every other node.
/// Each node can be killed (`SIGKILL`) and restarted on the same ports and
/// store; every node dies with the test process.
pub struct NatsCluster {
    nodes: Vec<NatsServer>,
    /// The monitoring (`http`) port of each node.
    http_ports: Vec<u16>,
}

impl NatsCluster {
    /// Starts `n` nodes (3 for streams at R3) and waits until the cluster
    /// has a JetStream meta leader.
    pub fn start(n: usize) -> Result<Self, TestkitError> {
        Self::start_with(n, &ClusterSecurity::default())
    }

    /// [`NatsCluster::start`] with `security`: every node's config gets
    /// its client-side text and files (TLS, users), and the routes between
    /// the nodes authenticate (and speak TLS) as it says.
    pub fn start_with(n: usize, security: &ClusterSecurity) -> Result<Self, TestkitError> {
        // 3n distinct ports: each held until all are chosen.
        let held = (0..3 * n)
            .map(|_| TcpListener::bind("127.0.0.1:0"))
            .collect::<std::io::Result<Vec<_>>>()?;
        let ports = held
            .iter()
            .map(|l| l.local_addr().map(|a| a.port()))
            .collect::<std::io::Result<Vec<u16>>>()?;
        drop(held);
        let (client, rest) = ports.split_at(n);
        let (route, http) = rest.split_at(n);
        let http = http.to_vec();
        let mut nodes = Vec::with_capacity(n);
        let credentials = security
            .route_auth
            .as_ref()
            .map(|(user, password)| format!("{user}:{password}@"))
            .unwrap_or_default();
        let mut cluster_extra = String::new();
        if let Some((user, password)) = &security.route_auth {
            cluster_extra.push_str(&format!(
                "  authorization {{\n    user: \"{user}\"\n    password: \"{password}\"\n    timeout: 5\n  }}\n"
            ));
        }
        if let Some(tls) = &security.route_tls {
            cluster_extra.push_str(&format!("  tls {{\n{tls}\n  }}\n"));
        }
        for i in 0..n {
            let routes: Vec<String> = (0..n)
                .filter(|&j| j != i)
                .map(|j| format!("nats://{credentials}127.0.0.1:{}", route[j]))
                .collect();
            let text = format!(
                "server_name: n{i}\n\
                 http: 127.0.0.1:{http}\n\
                 jetstream {{\n  sync_interval: {CLUSTER_SYNC_INTERVAL}\n}}\n\
                 cluster {{\n  name: asyncrl-test\n  listen: 127.0.0.1:{route}\n  routes: [{routes}]\n{cluster_extra}}}\n{client}",
                http = http[i],
                route = route[i],
                routes = routes.join(", "),
                client = security.client.text,
            );
            let config = ServerConfig {
                text,
                files: security.client.files.clone(),
                env: security.client.env.clone(),
            };
            nodes.push(NatsServer::prepare(client[i], &config)?);
        }
        // Started together: a node that waited for its peers before
        // answering would hold up the next one's start.
        for node in &mut nodes {
            node.spawn_process()?;
        }
        for node in &mut nodes {
            node.wait_ready(Duration::from_secs(30))?;
        }
        let mut cluster = Self {
            nodes,
            http_ports: http,
        };
        cluster.wait_meta_leader(Duration::from_secs(30))?;
        Ok(cluster)
    }

    /// A "cluster" of one server started elsewhere (no routes, no
    /// monitoring port: [`NatsCluster::jsz`] answers None).
    pub fn of_one(server: NatsServer) -> Self {
        Self {
            nodes: vec![server],
            http_ports: vec![0],
        }
    }

    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// The seed list the clients use: every node's URL, comma-separated
    /// (as `bus.url` takes it).
    pub fn urls(&self) -> String {
        self.nodes
            .iter()
            .map(NatsServer::url)
            .collect::<Vec<_>>()
            .join(",")
    }

    /// The `server_name` of node `i`.
    pub fn name(&self, i: usize) -> String {
        format!("n{i}")
    }

    /// The node with `server_name` `name`.
    pub fn index_of(&self, name: &str) -> Option<usize> {
        (0..self.len()).find(|&i| self.name(i) == name)
    }

    pub fn node(&mut self, i: usize) -> &mut NatsServer {
        &mut self.nodes[i]
    }

    pub fn nodes(&self) -> &[NatsServer] {
        &self.nodes
    }

    /// Kills node `i` with SIGKILL, as a crash would.
    pub fn kill9(&mut self, i: usize) {
        self.nodes[i].kill();
    }

    /// Starts node `i` again on the same ports and store.
    pub fn restart(&mut self, i: usize) -> Result<(), TestkitError> {
        self.nodes[i].restart()
    }

    /// Node `i`'s `/jsz` with `query`, parsed (None while it is down or
    /// does not answer).
    pub fn jsz(&mut self, i: usize, query: &str) -> Option<serde_json::Value> {
        if self.http_ports[i] == 0 || !self.nodes[i].is_running() {
            return None;
        }
        let body = http_get(self.http_ports[i], &format!("/jsz{query}")).ok()?;
        serde_json::from_str(&body).ok()
    }

    /// The JetStream meta leader as a running node sees it.
    pub fn meta_leader(&mut self) -> Option<String> {
        (0..self.len()).find_map(|i| {
            let jsz = self.jsz(i, "")?;
            let leader = jsz["meta_cluster"]["leader"].as_str()?;
            (!leader.is_empty()).then(|| leader.to_owned())
        })
    }

    /// Waits until the cluster has a meta leader that is running.
    pub fn wait_meta_leader(&mut self, timeout: Duration) -> Result<String, TestkitError> {
        self.poll(timeout, "a JetStream meta leader", |c| {
            c.meta_leader()
                .filter(|l| c.index_of(l).is_some_and(|i| c.nodes[i].is_running()))
        })
    }

    /// Waits until the meta leader counts every other node as a current
    /// peer, and returns it. A leader elected while a node is still joining
    /// (two of three are a quorum) and killed at once leaves two nodes of
    /// which one is not yet a voter of the meta group: no new leader is
    /// elected until the killed one returns.
    pub fn wait_meta_group_formed(&mut self, timeout: Duration) -> Result<String, TestkitError> {
        let others = self.len().saturating_sub(1);
        self.poll(
            timeout,
            "a meta leader with every node a current peer",
            |c| {
                let leader = c.meta_leader()?;
                // Only the leader lists the peers (`jsz` is None for a node
                // that is down).
                let jsz = c.jsz(c.index_of(&leader)?, "")?;
                let current = jsz["meta_cluster"]["replicas"]
                    .as_array()?
                    .iter()
                    .filter(|r| r["current"].as_bool() == Some(true))
                    .count();
                (current == others).then_some(leader)
            },
        )
    }

    /// The node that leads stream `stream` (of any account), as the running
    /// nodes report it in `/jsz?streams=true` (None: no leader now).
    pub fn stream_leader(&mut self, stream: &str) -> Option<usize> {
        (0..self.len()).find_map(|i| {
            let jsz = self.jsz(i, "?accounts=true&streams=true")?;
            let accounts = jsz["account_details"].as_array()?.clone();
            accounts.iter().find_map(|a| {
                a["stream_detail"].as_array()?.iter().find_map(|s| {
                    if s["name"].as_str() != Some(stream) {
                        return None;
                    }
                    let leader = s["cluster"]["leader"].as_str()?;
                    let idx = self.index_of(leader)?;
                    self.nodes[idx].is_running().then_some(idx)
                })
            })
        })
    }

    /// Waits until stream `stream` has a running leader, and returns it.
    pub fn wait_stream_leader(
        &mut self,
        stream: &str,
        timeout: Duration,
    ) -> Result<usize, TestkitError> {
        self.poll(timeout, &format!("a leader of stream {stream}"), |c| {
            c.stream_leader(stream)
        })
    }

    /// The current replicas of stream `stream` (its leader plus the
    /// followers that are up and caught up), by node, as its leader
    /// reports them (only the leader knows how its followers stand).
    pub fn stream_peers(&mut self, stream: &str) -> Vec<usize> {
        let Some(leader) = self.stream_leader(stream) else {
            return Vec::new();
        };
        let Some(jsz) = self.jsz(leader, "?accounts=true&streams=true") else {
            return Vec::new();
        };
        let mut out = vec![leader];
        for s in jsz["account_details"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|a| a["stream_detail"].as_array())
            .flatten()
            .filter(|s| s["name"].as_str() == Some(stream))
        {
            let cluster = &s["cluster"];
            if cluster["leader"].as_str() != Some(self.name(leader).as_str()) {
                continue;
            }
            out.extend(
                cluster["replicas"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    // A replica that is down or behind is not one.
                    .filter(|r| {
                        r["current"].as_bool() == Some(true) && r["offline"].as_bool() != Some(true)
                    })
                    .filter_map(|r| r["name"].as_str())
                    .filter_map(|n| self.index_of(n)),
            );
        }
        out.sort_unstable();
        out.dedup();
        out
    }

    /// Every stream of every account with its configured replicas
    /// (`num_replicas`), as a running node reports them: KV buckets are
    /// `KV_<bucket>`, object stores `OBJ_<bucket>`.
    pub fn stream_replicas(&mut self) -> std::collections::BTreeMap<String, u64> {
        let mut out = std::collections::BTreeMap::new();
        for i in 0..self.len() {
            let Some(jsz) = self.jsz(i, "?accounts=true&streams=true&config=true") else {
                continue;
            };
            for s in jsz["account_details"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|a| a["stream_detail"].as_array())
                .flatten()
            {
                if let (Some(name), Some(r)) =
                    (s["name"].as_str(), s["config"]["num_replicas"].as_u64())
                {
                    out.insert(name.to_owned(), r);
                }
            }
        }
        out
    }

    fn poll<T>(
        &mut self,
        timeout: Duration,
        what: &str,
        mut f: impl FnMut(&mut Self) -> Option<T>,
    ) -> Result<T, TestkitError> {
        let start = Instant::now();
        loop {
            if let Some(v) = f(self) {
                return Ok(v);
            }
            if start.elapsed() > timeout {
                let logs: Vec<String> = self
                    .nodes
                    .iter()
                    .enumerate()
                    .map(|(i, n)| format!("n{i}: {}", n.log_tail()))
                    .collect();
                return Err(TestkitError::NotReady {
                    port: self.nodes[0].port,
                    timeout,
                    log: format!("no {what}; {}", logs.join("\n")),
                });
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// A minimal HTTP/1.0 GET against 127.0.0.1 (the body of a 200 reply).
pub fn http_get(port: u16, path: &str) -> std::io::Result<String> {
    use std::io::Write;
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    write!(
        s,
        "GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    )?;
    let mut text = String::new();
    s.read_to_string(&mut text)?;
    let (head, body) = text
        .split_once("\r\n\r\n")
        .ok_or_else(|| std::io::Error::other("no HTTP header"))?;
    if !head.starts_with("HTTP/1.1 200") && !head.starts_with("HTTP/1.0 200") {
        return Err(std::io::Error::other(format!("HTTP status: {head}")));
    }
    Ok(body.to_owned())
}

/// Polls `f` until it returns `Some`, and returns that; panics naming `what`
/// after `timeout`. Time is tokio's, so a test on paused time waits in
/// virtual time.
pub async fn eventually<T, F, Fut>(what: &str, timeout: std::time::Duration, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what}"
        );
        tokio::time::sleep(POLL).await;
    }
}

/// Polls `f` until it holds (true) or `timeout` passes (false).
pub async fn wait_until(timeout: std::time::Duration, mut f: impl FnMut() -> bool) -> bool {
    let deadline = tokio::time::Instant::now() + timeout;
    while tokio::time::Instant::now() < deadline {
        if f() {
            return true;
        }
        tokio::time::sleep(POLL).await;
    }
    f()
}

/// How often [`eventually`] and [`wait_until`] look.
const POLL: std::time::Duration = std::time::Duration::from_millis(5);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_config_file_with_its_includes_and_environment_is_used_across_restarts() {
        let config = ServerConfig::new("include auth.conf\n")
            .file("auth.conf", "authorization { token: $TESTKIT_TOKEN }\n")
            .env("TESTKIT_TOKEN", "t0ken");
        let mut s = NatsServer::start_with_config(&config).unwrap();
        let info = |port: u16| {
            let stream = TcpStream::connect(("127.0.0.1", port)).unwrap();
            let mut line = String::new();
            BufReader::new(stream).read_line(&mut line).unwrap();
            line
        };
        assert!(info(s.port()).contains("\"auth_required\":true"));
        s.restart().unwrap();
        assert!(info(s.port()).contains("\"auth_required\":true"));
    }

    #[test]
    fn a_three_node_cluster_elects_a_new_meta_leader_when_its_leader_is_killed() {
        let mut c = NatsCluster::start(3).unwrap();
        assert_eq!(c.urls().split(',').count(), 3);
        let leader = c.wait_meta_group_formed(Duration::from_secs(30)).unwrap();
        let i = c.index_of(&leader).unwrap();
        c.kill9(i);
        let next = c.wait_meta_leader(Duration::from_secs(30)).unwrap();
        assert_ne!(next, leader);
        c.restart(i).unwrap();
        assert!(c.node(i).is_running());
    }

    /// Creates stream `name` at R3 through the JetStream API, over the
    /// plain NATS protocol. A request the cluster does not answer yet (no
    /// JetStream leader for it), or answers with "no suitable peers" (a
    /// cluster just started, its peers not all known to the meta leader
    /// yet: err_code 10005), is sent again: creating the same stream twice
    /// is no change.
    fn create_r3_stream(port: u16, name: &str) -> String {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let reply = try_create_r3_stream(port, name);
            match reply {
                Some(r) if !r.contains("\"err_code\":10005") => return r,
                other => assert!(
                    Instant::now() < deadline,
                    "stream {name} was never created: {other:?}"
                ),
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn try_create_r3_stream(port: u16, name: &str) -> Option<String> {
        use std::io::Write;
        let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
        s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
        let body = format!(r#"{{"name":"{name}","subjects":["{name}.>"],"num_replicas":3}}"#);
        write!(
            s,
            "CONNECT {{\"verbose\":false}}\r\nSUB reply 1\r\n\
             PUB $JS.API.STREAM.CREATE.{name} reply {}\r\n{body}\r\nPING\r\n",
            body.len()
        )
        .ok()?;
        let mut r = BufReader::new(s);
        let mut line = String::new();
        loop {
            line.clear();
            if r.read_line(&mut line).ok()? == 0 {
                return None;
            }
            if line.starts_with("MSG reply") {
                line.clear();
                r.read_line(&mut line).ok()?;
                return Some(line);
            }
        }
    }

    #[test]
    fn a_stream_at_r3_gets_a_new_leader_when_its_leader_is_killed() {
        let mut c = NatsCluster::start(3).unwrap();
        // The JetStream API answers only once the cluster has a meta leader.
        c.wait_meta_leader(Duration::from_secs(60)).unwrap();
        let port = c.node(0).port();
        let reply = create_r3_stream(port, "T");
        assert!(reply.contains("\"num_replicas\":3"), "{reply}");
        let leader = c.wait_stream_leader("T", Duration::from_secs(30)).unwrap();
        assert_eq!(c.stream_replicas().get("T"), Some(&3));
        let deadline = Instant::now() + Duration::from_secs(30);
        while c.stream_peers("T") != [0, 1, 2] {
            assert!(Instant::now() < deadline, "{:?}", c.stream_peers("T"));
            std::thread::sleep(Duration::from_millis(50));
        }
        c.kill9(leader);
        let next = c.wait_stream_leader("T", Duration::from_secs(30)).unwrap();
        assert_ne!(next, leader);
        assert!(!c.stream_peers("T").contains(&leader));
    }

    #[test]
    fn starts_kills_and_restarts_on_the_same_port() {
        let mut s = NatsServer::start().unwrap();
        let port = s.port();
        assert!(s.is_running());
        s.kill();
        assert!(!s.is_running());
        assert!(TcpStream::connect(("127.0.0.1", port)).is_err());
        s.restart().unwrap();
        assert_eq!(s.port(), port);
        assert!(TcpStream::connect(("127.0.0.1", port)).is_ok());
    }
}
