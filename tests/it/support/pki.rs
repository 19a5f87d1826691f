//! A test PKI: a CA, a server certificate for `localhost`/`127.0.0.1` and a client
//! certificate it signed, and a CA that signed nothing, as PEM files (and the server's
//! DER for rustls servers).

use std::path::PathBuf;

pub struct Pki {
    pub dir: tempfile::TempDir,
    pub ca: PathBuf,
    pub server_cert: PathBuf,
    pub server_key: PathBuf,
    pub client_cert: PathBuf,
    pub client_key: PathBuf,
    /// A CA that signed nothing here.
    pub other_ca: PathBuf,
    pub server_cert_der: Vec<u8>,
    pub server_key_der: Vec<u8>,
}

pub fn pki() -> Pki {
    use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
    let ca = |name: &str| {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, name);
        let cert = params.self_signed(&key).unwrap();
        (cert, params, key)
    };
    // Distinct names: with rcgen's default name on both, OpenSSL (librdkafka) takes the
    // leaf for a self-signed certificate and refuses it.
    let (ca_cert, ca_params, ca_key) = ca("mailroom test CA");
    let issuer = Issuer::new(ca_params, ca_key);
    let leaf = |names: Vec<String>| {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(names.clone()).unwrap();
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, names[0].clone());
        let cert = params.signed_by(&key, &issuer).unwrap();
        (cert, key)
    };
    let (server, server_key) = leaf(vec!["localhost".into(), "127.0.0.1".into()]);
    let (client, client_key) = leaf(vec!["mailroom".into()]);
    let (other, _, _) = ca("another CA");

    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, text: String| {
        let p = dir.path().join(name);
        std::fs::write(&p, text).unwrap();
        p
    };
    Pki {
        ca: write("ca.pem", ca_cert.pem()),
        server_cert: write("server.pem", server.pem()),
        server_key: write("server.key", server_key.serialize_pem()),
        client_cert: write("client.pem", client.pem()),
        client_key: write("client.key", client_key.serialize_pem()),
        other_ca: write("other-ca.pem", other.pem()),
        server_cert_der: server.der().to_vec(),
        server_key_der: server_key.serialize_der(),
        dir,
    }
}
