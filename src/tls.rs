//! TLS settings as PEM file paths, and the tonic configurations built from them: the
//! gRPC port's (`ServerTls`) and every gRPC client's (`ClientTls`: the inbox's handler
//! client, `mailroom admin`, the OTLP exporter). Files are read when the configuration
//! is built; errors name the file, never its content.

use std::path::{Path, PathBuf};

use anyhow::Context as _;
use tonic::transport::{Certificate, ClientTlsConfig, Identity, ServerTlsConfig};

/// TLS of a gRPC client. All unset: the webpki roots verify an `https://` server, and no
/// client certificate is presented.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ClientTls {
    /// CA certificates that verify the server [default: the webpki roots].
    pub ca: Option<PathBuf>,
    /// Client certificate for mTLS; goes with `key`.
    pub cert: Option<PathBuf>,
    /// Private key of `cert`.
    pub key: Option<PathBuf>,
}

impl ClientTls {
    /// The tonic client configuration.
    pub fn tonic(&self) -> anyhow::Result<ClientTlsConfig> {
        let mut c = ClientTlsConfig::new();
        c = match &self.ca {
            Some(ca) => c.ca_certificate(Certificate::from_pem(read(ca, "CA")?)),
            None => c.with_webpki_roots(),
        };
        match (&self.cert, &self.key) {
            (Some(cert), Some(key)) => {
                c = c.identity(Identity::from_pem(
                    read(cert, "client certificate")?,
                    read(key, "client key")?,
                ));
            }
            (None, None) => {}
            _ => {
                anyhow::bail!("a TLS client certificate needs its key and the key its certificate")
            }
        }
        Ok(c)
    }
}

/// TLS of the gRPC port.
#[derive(Debug, Clone, PartialEq)]
pub struct ServerTls {
    /// Certificate chain.
    pub cert: PathBuf,
    /// Private key of `cert`.
    pub key: PathBuf,
    /// Set: clients must present a certificate signed by one of these CAs.
    pub client_ca: Option<PathBuf>,
}

impl ServerTls {
    /// The tonic server configuration.
    pub fn tonic(&self) -> anyhow::Result<ServerTlsConfig> {
        let identity =
            Identity::from_pem(read(&self.cert, "certificate")?, read(&self.key, "key")?);
        let mut c = ServerTlsConfig::new().identity(identity);
        if let Some(ca) = &self.client_ca {
            c = c.client_ca_root(Certificate::from_pem(read(ca, "client CA")?));
        }
        Ok(c)
    }
}

fn read(p: &Path, what: &str) -> anyhow::Result<Vec<u8>> {
    std::fs::read(p).with_context(|| format!("reading the TLS {what} {}", p.display()))
}
