//! The admin client: the connection to a server's AdminService with the operator's
//! token, what every command is about, and how an RPC's failure becomes the command's.

use std::time::Duration;

use anyhow::Context as _;
use tonic::Request;
use tonic::metadata::MetadataValue;
use tonic::transport::Channel;

use super::AdminArgs;
use crate::pb::admin_service_client::AdminServiceClient;

pub(super) struct Client {
    pub(super) inner: AdminServiceClient<Channel>,
    token: Option<MetadataValue<tonic::metadata::Ascii>>,
}

impl Client {
    pub(super) fn req<T>(&self, msg: T) -> Request<T> {
        let mut r = Request::new(msg);
        if let Some(t) = &self.token {
            r.metadata_mut().insert("authorization", t.clone());
        }
        r
    }
}

/// A failed RPC: its gRPC code (for the exit status) and the message printed.
#[derive(Debug)]
pub struct RpcFailure {
    pub(super) code: tonic::Code,
    message: String,
}

impl std::fmt::Display for RpcFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for RpcFailure {}

/// The status as the command's error, its code named as gRPC names it
/// (`INVALID_ARGUMENT`). A transport failure (refused, TLS handshake) travels as the
/// status's source chain: each cause is named once.
pub(super) fn rpc_error(s: tonic::Status) -> anyhow::Error {
    let mut message = format!("{}: {}", crate::pb::code_name(s.code()), s.message());
    let mut source = std::error::Error::source(&s);
    while let Some(e) = source {
        let cause = e.to_string();
        if !message.contains(&cause) {
            message.push_str(": ");
            message.push_str(&cause);
        }
        source = e.source();
    }
    anyhow::Error::new(RpcFailure {
        code: s.code(),
        message,
    })
}

/// The exit status of a failed command (docs/admin.md, "Exit status"): 3 not found, 4
/// refused (token or scope), 5 unreachable or unavailable, 6 a request the server
/// rejected (invalid, wrong state, conflict), 1 anything else. Usage errors exit with 2
/// (clap's).
pub fn exit_code(e: &anyhow::Error) -> u8 {
    use tonic::Code;
    if let Some(f) = e.chain().find_map(|c| c.downcast_ref::<RpcFailure>()) {
        return match f.code {
            Code::NotFound => 3,
            Code::Unauthenticated | Code::PermissionDenied => 4,
            Code::Unavailable | Code::DeadlineExceeded => 5,
            Code::InvalidArgument
            | Code::FailedPrecondition
            | Code::AlreadyExists
            | Code::OutOfRange => 6,
            _ => 1,
        };
    }
    if e.chain()
        .any(|c| c.downcast_ref::<tonic::transport::Error>().is_some())
    {
        return 5;
    }
    1
}

/// An RPC's answer, or its status as the command's error.
pub(super) fn answer<T>(r: Result<tonic::Response<T>, tonic::Status>) -> anyhow::Result<T> {
    r.map(tonic::Response::into_inner).map_err(rpc_error)
}

pub(super) fn operator(o: Option<String>) -> String {
    o.or_else(|| std::env::var("USER").ok()).unwrap_or_default()
}

/// A request id for an action: the operator's, or a new one.
pub(super) fn request_id(given: Option<String>) -> String {
    given.unwrap_or_else(|| uuid::Uuid::new_v4().to_string())
}

/// Connects to `--server` (TLS for https://) with the operator's token.
pub(super) async fn connect(args: &AdminArgs) -> anyhow::Result<Client> {
    let mut endpoint = Channel::from_shared(args.server.clone())
        .context("--server is not a URL")?
        .connect_timeout(Duration::from_secs(5));
    let tls = crate::tls::ClientTls {
        ca: args.ca.clone(),
        cert: args.cert.clone(),
        key: args.client_key.clone().or_else(|| args.key.clone()),
    };
    if args.server.starts_with("https://") {
        endpoint = endpoint
            .tls_config(tls.tonic()?)
            .context("TLS configuration")?;
    } else if tls != crate::tls::ClientTls::default() {
        anyhow::bail!("--ca/--cert/--client-key need an https:// --server");
    }
    let channel = endpoint
        .connect()
        .await
        .with_context(|| format!("connecting to {}", args.server))?;
    let token = match args.token.as_deref().filter(|t| !t.is_empty()) {
        None => None,
        Some(t) => Some(
            format!("Bearer {t}")
                .parse()
                .context("the token must be printable ASCII")?,
        ),
    };
    Ok(Client {
        inner: AdminServiceClient::new(channel),
        token,
    })
}

/// What every command is about: the box (and subscription), and the output format.
pub(super) struct Target {
    pub(super) bx: i32,
    pub(super) inbox: bool,
    pub(super) sub: String,
    pub(super) json: bool,
}
