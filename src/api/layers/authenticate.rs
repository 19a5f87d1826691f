//! Every RPC checked against the token table before any handler runs, by its bearer
//! token or (mTLS) its client certificate: the caller's `Principal` rides in the
//! request's extensions; a refusal is answered here.

use std::sync::Arc;

use tonic::codegen::http;

use super::{Inner, Middleware, MiddlewareLayer, Outcome};
use crate::access::{Auth, required_scope};

/// Checks the bearer token or client certificate of every RPC against the scope its
/// method needs.
#[derive(Clone)]
pub struct Authenticate {
    auth: Arc<Auth>,
}

/// The layer of `Authenticate`.
pub type AuthLayer = MiddlewareLayer<Authenticate>;

impl AuthLayer {
    /// The layer over the token table `auth`.
    pub fn new(auth: Auth) -> Self {
        MiddlewareLayer(Authenticate {
            auth: Arc::new(auth),
        })
    }
}

impl Middleware for Authenticate {
    fn call<S, B, RB>(&self, inner: &mut S, mut req: http::Request<B>) -> Outcome<RB, S::Error>
    where
        S: Inner<B, RB>,
        RB: Default + Send + 'static,
    {
        let scope = required_scope(req.uri().path());
        let certificate = certificate_identity(req.extensions());
        match self.auth.check(
            scope,
            req.headers().get("authorization"),
            certificate.as_deref(),
        ) {
            Ok(principal) => {
                req.extensions_mut().insert(principal);
                Box::pin(inner.call(req))
            }
            Err(e) => Box::pin(async move { Ok(tonic::Status::from(e).into_http()) }),
        }
    }
}

/// The verified client certificate's identity (mTLS): its first DNS, URI or e-mail
/// subject alternative name, else its subject's common name. `None` without a client
/// certificate (tonic verified it against the client CA before any request).
fn certificate_identity(ext: &http::Extensions) -> Option<String> {
    use tonic::transport::server::{TcpConnectInfo, TlsConnectInfo};
    use x509_parser::extensions::GeneralName;
    let certs = ext.get::<TlsConnectInfo<TcpConnectInfo>>()?.peer_certs()?;
    let (_, cert) = x509_parser::parse_x509_certificate(certs.first()?.as_ref()).ok()?;
    if let Ok(Some(san)) = cert.subject_alternative_name() {
        for name in &san.value.general_names {
            match name {
                GeneralName::DNSName(n) | GeneralName::URI(n) | GeneralName::RFC822Name(n) => {
                    return Some((*n).to_string());
                }
                _ => {}
            }
        }
    }
    cert.subject()
        .iter_common_name()
        .next()
        .and_then(|cn| cn.as_str().ok())
        .map(str::to_string)
}
