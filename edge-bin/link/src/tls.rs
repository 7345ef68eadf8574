//! Mutual TLS for backend links (PROTOCOL.md §9.3, an option beside the link secret): the
//! edge connects as a TLS client presenting its certificate; the backend accepts only
//! clients whose certificate chains to the configured CA, and the edge verifies the
//! backend's certificate the same way. rustls with the ring provider only; PEM files in.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::crypto::CryptoProvider;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

/// The three files of one end of a TLS link: the CA both ends' certificates chain to, this
/// end's certificate chain (leaf first) and its private key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LinkTlsFiles {
    /// PEM CA certificate(s) the peer's certificate must chain to.
    pub ca: PathBuf,
    /// PEM certificate chain of this end, leaf first.
    pub cert: PathBuf,
    /// PEM private key of this end (PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn roots(ca: &Path) -> Result<Arc<rustls::RootCertStore>, String> {
    let mut roots = rustls::RootCertStore::empty();
    let certs = CertificateDer::pem_file_iter(ca)
        .map_err(|e| format!("link CA file {}: {e}", ca.display()))?;
    for cert in certs {
        let cert = cert.map_err(|e| format!("link CA file {}: {e}", ca.display()))?;
        roots
            .add(cert)
            .map_err(|e| format!("link CA file {}: {e}", ca.display()))?;
    }
    if roots.is_empty() {
        return Err(format!(
            "link CA file {} holds no certificate",
            ca.display()
        ));
    }
    Ok(Arc::new(roots))
}

fn identity(
    files: &LinkTlsFiles,
) -> Result<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>), String> {
    let chain = CertificateDer::pem_file_iter(&files.cert)
        .map_err(|e| format!("link certificate {}: {e}", files.cert.display()))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("link certificate {}: {e}", files.cert.display()))?;
    if chain.is_empty() {
        return Err(format!(
            "link certificate {} holds no certificate",
            files.cert.display()
        ));
    }
    let key = PrivateKeyDer::from_pem_file(&files.key)
        .map_err(|e| format!("link key {}: {e}", files.key.display()))?;
    Ok((chain, key))
}

/// The backend's side: presents its certificate and requires a client certificate that
/// chains to `files.ca`.
pub fn server_config(files: &LinkTlsFiles) -> Result<Arc<rustls::ServerConfig>, String> {
    let verifier =
        rustls::server::WebPkiClientVerifier::builder_with_provider(roots(&files.ca)?, provider())
            .build()
            .map_err(|e| format!("link client verifier: {e}"))?;
    let (chain, key) = identity(files)?;
    let config = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_client_cert_verifier(verifier)
        .with_single_cert(chain, key)
        .map_err(|e| format!("link certificate: {e}"))?;
    Ok(Arc::new(config))
}

/// The edge's side: verifies the backend's certificate against `files.ca` and presents its
/// own.
pub fn client_config(files: &LinkTlsFiles) -> Result<Arc<rustls::ClientConfig>, String> {
    let (chain, key) = identity(files)?;
    let config = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots(&files.ca)?)
        .with_client_auth_cert(chain, key)
        .map_err(|e| format!("link certificate: {e}"))?;
    Ok(Arc::new(config))
}
