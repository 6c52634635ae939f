//! The admin API: the `CoordinatorAdmin` gRPC service from protos/, TLS
//! optional. Reads are open; mutating calls (SetKnobs, Pause, Resume,
//! Checkpoint) need `authorization: Bearer <token>`, and every refusal is
//! journaled like any other outcome.

use std::net::SocketAddr;
use std::path::Path;

use asyncrl_config::CoordinatorConfig;
use asyncrl_protos::v1::coordinator_admin_server::{CoordinatorAdmin, CoordinatorAdminServer};
use asyncrl_protos::v1::{
    CheckpointRequest, ControlReply, GetKnobsReply, GetKnobsRequest, ListWorkersReply,
    ListWorkersRequest, PauseRequest, ResumeRequest, SetKnobsReply, SetKnobsRequest, StatusReply,
    StatusRequest,
};
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use tonic::transport::server::TcpIncoming;
use tonic::transport::{Identity, Server, ServerTlsConfig};
use tonic::{Request, Response, Status};

use crate::error::CoordinatorError;
use crate::service::{AdminCommand, ControlAction, Event, Unauthorized};

/// Reads the admin token from the config (inline or file). `None`: no token
/// configured, every mutating call is refused.
pub async fn load_admin_token(c: &CoordinatorConfig) -> Result<Option<String>, CoordinatorError> {
    if let Some(t) = &c.admin_token {
        return Ok(Some(t.trim().to_owned()));
    }
    let Some(path) = &c.admin_token_file else {
        return Ok(None);
    };
    read_token_file(path).await.map(Some)
}

async fn read_token_file(path: &Path) -> Result<String, CoordinatorError> {
    let text = tokio::fs::read_to_string(path).await.map_err(|source| {
        CoordinatorError::AdminTokenFile {
            path: path.to_owned(),
            source,
        }
    })?;
    let token = text.trim().to_owned();
    if token.is_empty() {
        return Err(CoordinatorError::AdminTokenEmpty(path.to_owned()));
    }
    Ok(token)
}

/// Compares without an early exit on the first differing byte.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[derive(Clone)]
struct AdminService {
    tx: mpsc::Sender<Event>,
    token: Option<String>,
}

impl AdminService {
    fn authorize<T>(&self, req: &Request<T>) -> Result<(), Unauthorized> {
        let Some(token) = &self.token else {
            return Err(Unauthorized(
                "the coordinator has no admin token configured (coordinator.admin_token or admin_token_file); mutating calls are refused".into(),
            ));
        };
        let Some(header) = req.metadata().get("authorization") else {
            return Err(Unauthorized(
                "missing `authorization: Bearer <token>`".into(),
            ));
        };
        let given = header
            .to_str()
            .ok()
            .and_then(|h| h.strip_prefix("Bearer "))
            .map(str::trim);
        match given {
            Some(given) if constant_time_eq(given.as_bytes(), token.as_bytes()) => Ok(()),
            Some(_) => Err(Unauthorized("wrong bearer token".into())),
            None => Err(Unauthorized(
                "the authorization header is not `Bearer <token>`".into(),
            )),
        }
    }

    async fn ask<R>(
        &self,
        make: impl FnOnce(oneshot::Sender<R>) -> AdminCommand,
    ) -> Result<R, Status> {
        let (tx, rx) = oneshot::channel();
        self.tx
            .send(Event::Admin(make(tx)))
            .await
            .map_err(|_| Status::unavailable("the coordinator is shutting down"))?;
        rx.await
            .map_err(|_| Status::unavailable("the coordinator is shutting down"))
    }
}

fn peer<T>(req: &Request<T>) -> Option<String> {
    req.remote_addr().map(|a| a.to_string())
}

fn refused(u: Unauthorized) -> Status {
    Status::unauthenticated(u.0)
}

#[tonic::async_trait]
impl CoordinatorAdmin for AdminService {
    async fn status(&self, _req: Request<StatusRequest>) -> Result<Response<StatusReply>, Status> {
        self.ask(AdminCommand::Status).await.map(Response::new)
    }

    async fn list_workers(
        &self,
        _req: Request<ListWorkersRequest>,
    ) -> Result<Response<ListWorkersReply>, Status> {
        self.ask(AdminCommand::Workers).await.map(Response::new)
    }

    async fn get_knobs(
        &self,
        _req: Request<GetKnobsRequest>,
    ) -> Result<Response<GetKnobsReply>, Status> {
        self.ask(AdminCommand::GetKnobs).await.map(Response::new)
    }

    async fn set_knobs(
        &self,
        req: Request<SetKnobsRequest>,
    ) -> Result<Response<SetKnobsReply>, Status> {
        let auth = self.authorize(&req);
        let peer = peer(&req);
        let req = req.into_inner();
        self.ask(|reply| AdminCommand::SetKnobs {
            req,
            peer,
            auth,
            reply,
        })
        .await?
        .map(Response::new)
        .map_err(refused)
    }

    async fn pause(&self, req: Request<PauseRequest>) -> Result<Response<ControlReply>, Status> {
        self.control(ControlAction::Pause, req, |r| r.requested_by)
            .await
    }

    async fn resume(&self, req: Request<ResumeRequest>) -> Result<Response<ControlReply>, Status> {
        self.control(ControlAction::Resume, req, |r| r.requested_by)
            .await
    }

    async fn checkpoint(
        &self,
        req: Request<CheckpointRequest>,
    ) -> Result<Response<ControlReply>, Status> {
        self.control(ControlAction::Checkpoint, req, |r| r.requested_by)
            .await
    }
}

impl AdminService {
    async fn control<T>(
        &self,
        action: ControlAction,
        req: Request<T>,
        who: impl FnOnce(T) -> String,
    ) -> Result<Response<ControlReply>, Status> {
        let auth = self.authorize(&req);
        let peer = peer(&req);
        let who = who(req.into_inner());
        self.ask(|reply| AdminCommand::Control {
            action,
            who,
            peer,
            auth,
            reply,
        })
        .await?
        .map(Response::new)
        .map_err(refused)
    }
}

/// Binds the admin API and serves it until `shutdown`. Returns the bound
/// address (port 0 picks one) and the server task.
pub(crate) async fn start(
    c: &CoordinatorConfig,
    addr: SocketAddr,
    tx: mpsc::Sender<Event>,
    shutdown: CancellationToken,
) -> Result<(SocketAddr, tokio::task::JoinHandle<()>), CoordinatorError> {
    let token = load_admin_token(c).await?;
    if token.is_none() {
        // Worth a warning where others can reach the API; on loopback (a
        // local run) it is the expected setup.
        if addr.ip().is_loopback() {
            tracing::info!(%addr, "no coordinator.admin_token configured: mutating admin calls will be refused");
        } else {
            tracing::warn!(%addr, "no coordinator.admin_token configured: mutating admin calls will be refused");
        }
    }
    let mut server = Server::builder();
    let mut tls = false;
    if let Some(t) = &c.admin_tls
        && let (Some(cert), Some(key)) = (&t.cert_file, &t.key_file)
    {
        async fn read(p: &Path) -> Result<Vec<u8>, CoordinatorError> {
            tokio::fs::read(p)
                .await
                .map_err(|source| CoordinatorError::AdminTlsFile {
                    path: p.to_owned(),
                    source,
                })
        }
        let identity = Identity::from_pem(read(cert).await?, read(key).await?);
        server = server
            .tls_config(ServerTlsConfig::new().identity(identity))
            .map_err(CoordinatorError::AdminTls)?;
        tls = true;
    }
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| CoordinatorError::AdminBind { addr, source })?;
    let bound = listener
        .local_addr()
        .map_err(|source| CoordinatorError::AdminBind { addr, source })?;
    let incoming = TcpIncoming::from(listener).with_nodelay(Some(true));
    let service = CoordinatorAdminServer::new(AdminService { tx, token });
    tracing::info!(addr = %bound, tls, "coordinator admin API listening");
    let handle = tokio::spawn(async move {
        if let Err(e) = server
            .add_service(service)
            .serve_with_incoming_shutdown(incoming, shutdown.cancelled())
            .await
        {
            tracing::error!(error = %e, "coordinator admin API failed");
        }
    });
    Ok((bound, handle))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_comparison() {
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"abcd"));
    }

    #[tokio::test]
    async fn token_file_errors_name_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("token");
        let c = CoordinatorConfig {
            admin_token_file: Some(p.clone()),
            ..Default::default()
        };
        let err = load_admin_token(&c).await.unwrap_err().to_string();
        assert!(err.contains(&p.display().to_string()), "{err}");
        std::fs::write(&p, "\n").unwrap();
        assert!(
            load_admin_token(&c)
                .await
                .unwrap_err()
                .to_string()
                .contains("empty")
        );
        std::fs::write(&p, "s3cret\n").unwrap();
        assert_eq!(
            load_admin_token(&c).await.unwrap().as_deref(),
            Some("s3cret")
        );
        assert_eq!(
            load_admin_token(&CoordinatorConfig::default())
                .await
                .unwrap(),
            None
        );
    }
}
