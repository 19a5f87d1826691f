//! Every RPC checked against the token table before any handler runs: the caller's
//! `Principal` rides in the request's extensions; a refusal is answered here.

use std::sync::Arc;

use tonic::codegen::http;

use super::{Inner, Middleware, MiddlewareLayer, Outcome};
use crate::api::auth::{Auth, required_scope};

/// Checks the bearer token of every RPC against the scope its method needs.
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
        match self.auth.check(scope, req.headers().get("authorization")) {
            Ok(principal) => {
                req.extensions_mut().insert(principal);
                Box::pin(inner.call(req))
            }
            Err(status) => Box::pin(async move { Ok(status.into_http()) }),
        }
    }
}
