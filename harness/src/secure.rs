//! A secured NATS for the cluster tests and the chaos soak, as production
//! runs it: TLS on the client and route ports with client certificates
//! verified (a test PKI made with rcgen), the roles' users and permissions
//! of the shipped `deploy/k8s/base/nats-auth.conf` (their passwords in the
//! servers' environment, as nats.yaml sets them), and routes that
//! authenticate. [`SecureNats::setup`] hands it to a
//! [`crate::cluster::Cluster`]; the chaos bench uses the parts.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::Context as _;
use asyncrl_config::{RoleAuth, Secret, TlsConfig};
use asyncrl_testkit::{ClusterSecurity, ServerConfig, workspace_root};
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};

use crate::cluster::NatsSetup;

/// PEM files of a test PKI.
#[derive(Debug, Clone)]
pub struct Pki {
    pub ca: PathBuf,
    /// For 127.0.0.1 and localhost; also a client certificate (a node's
    /// routes to the others present it).
    pub server_cert: PathBuf,
    pub server_key: PathBuf,
    pub client_cert: PathBuf,
    pub client_key: PathBuf,
}

fn write(dir: &Path, name: &str, pem: &str) -> anyhow::Result<PathBuf> {
    let path = dir.join(name);
    std::fs::write(&path, pem).with_context(|| format!("cannot write {}", path.display()))?;
    Ok(path)
}

/// A CA named `ca_name` and, signed by it, a server certificate for
/// 127.0.0.1 and localhost and a client certificate, written to `dir`.
pub fn make_pki(dir: &Path, ca_name: &str) -> anyhow::Result<Pki> {
    let ca_key = KeyPair::generate()?;
    let mut ca_params = CertificateParams::new(Vec::<String>::new())?;
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(DnType::CommonName, ca_name);
    ca_params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let ca_cert = ca_params.self_signed(&ca_key)?;
    let issuer = Issuer::new(ca_params, ca_key);

    let server_key = KeyPair::generate()?;
    let mut server = CertificateParams::new(vec!["127.0.0.1".to_owned(), "localhost".to_owned()])?;
    server
        .distinguished_name
        .push(DnType::CommonName, "nats-server");
    server.extended_key_usages = vec![
        ExtendedKeyUsagePurpose::ServerAuth,
        ExtendedKeyUsagePurpose::ClientAuth,
    ];
    let server_cert = server.signed_by(&server_key, &issuer)?;

    let client_key = KeyPair::generate()?;
    let mut client = CertificateParams::new(Vec::<String>::new())?;
    client
        .distinguished_name
        .push(DnType::CommonName, "asyncrl-role");
    client.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
    let client_cert = client.signed_by(&client_key, &issuer)?;

    Ok(Pki {
        ca: write(dir, "ca.pem", &ca_cert.pem())?,
        server_cert: write(dir, "server.pem", &server_cert.pem())?,
        server_key: write(dir, "server-key.pem", &server_key.serialize_pem())?,
        client_cert: write(dir, "client.pem", &client_cert.pem())?,
        client_key: write(dir, "client-key.pem", &client_key.serialize_pem())?,
    })
}

impl Pki {
    /// The body of a `tls {}` block that serves this PKI's server
    /// certificate and verifies its peers' certificates against the CA.
    pub fn verifying_tls_block(&self) -> String {
        format!(
            "  cert_file: \"{}\"\n  key_file: \"{}\"\n  ca_file: \"{}\"\n  verify: true\n  timeout: 5",
            self.server_cert.display(),
            self.server_key.display(),
            self.ca.display()
        )
    }

    /// `bus.tls` of a client of this PKI (CA, client certificate and key).
    pub fn client_tls(&self) -> TlsConfig {
        TlsConfig {
            required: true,
            ca_file: Some(self.ca.clone()),
            cert_file: Some(self.client_cert.clone()),
            key_file: Some(self.client_key.clone()),
        }
    }
}

/// The roles with a user in `nats-auth.conf`.
pub const ROLES: [&str; 4] = ["coordinator", "buffer", "learner", "worker"];

/// A secured NATS: its PKI, the roles' passwords, the test's own
/// unrestricted observer, and the route credentials.
#[derive(Debug, Clone)]
pub struct SecureNats {
    pub pki: Pki,
    passwords: BTreeMap<String, String>,
    pub observer: (String, String),
    pub route: (String, String),
}

impl SecureNats {
    /// A new PKI in `dir` and fresh passwords (`tag` makes them unique).
    pub fn new(dir: &Path, tag: &str) -> anyhow::Result<Self> {
        Ok(Self {
            pki: make_pki(dir, "asyncrl test CA")?,
            passwords: ROLES
                .iter()
                .map(|r| ((*r).to_owned(), format!("{r}-pw-{tag}")))
                .collect(),
            observer: ("observer".into(), format!("observer-pw-{tag}")),
            route: ("route".into(), format!("route-pw-{tag}")),
        })
    }

    /// The client side of every server's config: TLS that verifies
    /// clients, and the users of the shipped `nats-auth.conf` plus the
    /// observer.
    pub fn server_config(&self) -> anyhow::Result<ServerConfig> {
        let path = workspace_root().join("deploy/k8s/base/nats-auth.conf");
        let auth = std::fs::read_to_string(&path)
            .with_context(|| format!("cannot read {}", path.display()))?;
        let mut config = ServerConfig::new(format!(
            "tls {{\n{}\n}}\ninclude nats-auth.conf\nauthorization {{\n  users: [\n    $ASYNCRL_COORDINATOR\n    $ASYNCRL_BUFFER\n    $ASYNCRL_LEARNER\n    $ASYNCRL_WORKER\n    {{ user: \"{}\", password: \"{}\" }}\n  ]\n}}\n",
            self.pki.verifying_tls_block(),
            self.observer.0,
            self.observer.1
        ))
        .file("nats-auth.conf", auth);
        for (role, password) in &self.passwords {
            config = config.env(
                format!("NATS_{}_PASSWORD", role.to_uppercase()),
                password.clone(),
            );
        }
        Ok(config)
    }

    /// What a [`asyncrl_testkit::NatsCluster`] of these servers needs:
    /// the client side, route credentials, and TLS between the nodes.
    pub fn cluster_security(&self) -> anyhow::Result<ClusterSecurity> {
        Ok(ClusterSecurity {
            client: self.server_config()?,
            route_auth: Some(self.route.clone()),
            route_tls: Some(self.pki.verifying_tls_block()),
        })
    }

    /// `bus.roles`: each role's user and password.
    pub fn bus_roles(&self) -> BTreeMap<String, RoleAuth> {
        self.passwords
            .iter()
            .map(|(role, password)| {
                (
                    role.clone(),
                    RoleAuth {
                        user: Some(role.clone()),
                        password: Some(Secret::new(password.clone())),
                        ..RoleAuth::default()
                    },
                )
            })
            .collect()
    }

    /// The [`NatsSetup`] of a [`crate::cluster::Cluster`] on these servers
    /// (`nodes` of them: 1, or 3 for R3).
    pub fn setup(&self, nodes: usize) -> anyhow::Result<NatsSetup> {
        Ok(NatsSetup {
            server: Some(self.server_config()?),
            cluster_nodes: nodes,
            tls: true,
            bus_tls: Some(self.pki.client_tls()),
            bus_roles: self.bus_roles(),
            observer: Some(self.observer.clone()),
            observer_ca: Some(self.pki.ca.clone()),
            observer_cert: Some((self.pki.client_cert.clone(), self.pki.client_key.clone())),
            route_auth: Some(self.route.clone()),
            route_tls: Some(self.pki.verifying_tls_block()),
        })
    }
}
