//! Cluster security: a cluster CA, one certificate per proc signed by it, and
//! the rustls configurations for mutual TLS. `rdma/` reuses these for its
//! authenticated TCP path.
//!
//! A proc's certificate names the proc as its DNS subject alternative name,
//! so a dialer's TLS check of the server name is the check that it reached
//! the proc it meant to, and a listener checks a dialer's claimed proc with
//! [`verify_proc_identity`]. Only TLS 1.3 and the ring provider are used.
//! Private keys are never printed: the `Debug` forms leave them out.
//!
//! Every certificate also carries a [`Role`] (a URI subject alternative name
//! `regent-role:<role>`, signed with the rest) and a [`Validity`]. Both are
//! chosen by whoever issues it: [`ClusterCa::issue`] has no default for
//! either. Receivers read the role of a verified peer with [`peer_role`]; the
//! endpoint puts it on every delivery. Expiry is checked by both sides'
//! rustls verifiers at every handshake, and an endpoint closes a link when
//! its peer's certificate expires.

use std::fmt;
use std::fs;
use std::io::Write as _;
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, SanType,
};
use rustls::RootCertStore;
use rustls::crypto::CryptoProvider;
use rustls::server::WebPkiClientVerifier;
use rustls_pki_types::pem::PemObject as _;
use rustls_pki_types::{CertificateDer, DnsName, PrivateKeyDer, ServerName};
use x509_parser::extensions::GeneralName;
use x509_parser::prelude::{FromDer as _, X509Certificate};

use crate::error::Error;
use crate::id::ProcId;

/// The ALPN protocol name of regent's control plane.
pub const ALPN: &[u8] = b"regent/1";

/// The scheme of the URI subject alternative name that carries a
/// certificate's [`Role`]: `regent-role:controller`.
pub const ROLE_URI_SCHEME: &str = "regent-role";

fn tls(context: &'static str) -> impl FnOnce(rustls::Error) -> Error {
    move |e| Error::Tls {
        context,
        reason: e.to_string(),
    }
}

fn cert_err(context: &'static str) -> impl FnOnce(rcgen::Error) -> Error {
    move |e| Error::Certificate {
        context,
        reason: e.to_string(),
    }
}

/// The crypto provider of every config made here: ring's, with
/// TLS13_AES_128_GCM_SHA256 first. ring lists AES-256-GCM first; AES-128
/// runs 10 rounds per block where AES-256 runs 14, for every QUIC packet's
/// payload and header protection and every sealed payload record. The
/// server follows the client's order, and both sides use this provider.
pub fn crypto_provider() -> Arc<CryptoProvider> {
    use rustls::CipherSuite::TLS13_AES_128_GCM_SHA256;
    let mut provider = rustls::crypto::ring::default_provider();
    provider
        .cipher_suites
        .sort_by_key(|s| s.suite() != TLS13_AES_128_GCM_SHA256);
    Arc::new(provider)
}

/// What the holder of a certificate may do in the cluster. The transport
/// authenticates it (it is signed into the certificate) and hands it to
/// receivers ([`crate::Delivery::sender_role`]); what each role may ask is
/// decided by the receivers (`docs/semantics.md` §2.1 and §4.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Role {
    /// The controller of a job: owns procs, asks host agents to spawn,
    /// renew, signal and stop them.
    Controller,
    /// A host agent: starts procs for controllers.
    HostAgent,
    /// A proc: runs user code (actors). May talk to other procs and report
    /// to its host agent and owner; may not control procs.
    Proc,
}

impl Role {
    /// Every role.
    pub const ALL: [Role; 3] = [Role::Controller, Role::HostAgent, Role::Proc];

    /// The role's name: `controller`, `host-agent` or `proc`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Controller => "controller",
            Self::HostAgent => "host-agent",
            Self::Proc => "proc",
        }
    }

    /// The URI subject alternative name that carries the role.
    fn uri(self) -> String {
        format!("{ROLE_URI_SCHEME}:{}", self.as_str())
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Role {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self, Error> {
        Self::ALL
            .into_iter()
            .find(|r| r.as_str() == s)
            .ok_or_else(|| Error::Certificate {
                context: "role",
                reason: format!("{s:?} is not a role (controller, host-agent or proc)"),
            })
    }
}

/// When a certificate is valid. Certificates are issued for a bounded time
/// (a job's lifetime by default, [`Validity::JOB`]) and renewed by issuing
/// new ones; nothing is valid forever.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Validity {
    not_before: SystemTime,
    not_after: SystemTime,
}

impl Validity {
    /// A job's lifetime, the default validity of the certificates a
    /// controller issues: 7 days.
    pub const JOB: Duration = Duration::from_secs(7 * 24 * 3600);
    /// The default validity of a cluster CA made by [`ClusterCa::generate`]:
    /// 365 days.
    pub const CA: Duration = Duration::from_secs(365 * 24 * 3600);
    /// How far before now a certificate's validity starts, so that peers
    /// whose clocks are a little behind accept it: 5 minutes.
    pub const CLOCK_SKEW: Duration = Duration::from_secs(300);

    /// Valid from [`Self::CLOCK_SKEW`] ago until `valid_for` from now.
    pub fn for_duration(valid_for: Duration) -> Result<Self, Error> {
        let now = SystemTime::now();
        let bad = || Error::Certificate {
            context: "validity",
            reason: format!("{valid_for:?} from now is not a date"),
        };
        if valid_for.is_zero() {
            return Err(Error::Certificate {
                context: "validity",
                reason: "a validity of zero".into(),
            });
        }
        Self::between(
            now.checked_sub(Self::CLOCK_SKEW).unwrap_or(now),
            now.checked_add(valid_for).ok_or_else(bad)?,
        )
    }

    /// Valid for [`Self::JOB`] from now.
    pub fn job() -> Self {
        let now = SystemTime::now();
        Self {
            not_before: now.checked_sub(Self::CLOCK_SKEW).unwrap_or(now),
            // Invariant: the clock reads a date thousands of years before
            // SystemTime's limit, so 7 days later is one.
            not_after: now
                .checked_add(Self::JOB)
                .expect("7 days from now is a date"),
        }
    }

    /// Valid from `not_before` to `not_after` (both inclusive, to the
    /// second); `not_after` must be later. Dates in the past are allowed (a
    /// test may want an expired certificate).
    pub fn between(not_before: SystemTime, not_after: SystemTime) -> Result<Self, Error> {
        if not_after <= not_before {
            return Err(Error::Certificate {
                context: "validity",
                reason: "it ends before it starts".into(),
            });
        }
        // Both must be dates X.509 can carry (rcgen writes up to 9999).
        asn1_date(not_before)?;
        asn1_date(not_after)?;
        Ok(Self {
            not_before,
            not_after,
        })
    }

    /// The first moment it is valid.
    pub fn not_before(&self) -> SystemTime {
        self.not_before
    }

    /// The last moment it is valid.
    pub fn not_after(&self) -> SystemTime {
        self.not_after
    }
}

/// A date as rcgen writes it, or why it cannot be one.
fn asn1_date(t: SystemTime) -> Result<time::OffsetDateTime, Error> {
    let secs = match t.duration_since(UNIX_EPOCH) {
        Ok(d) => i64::try_from(d.as_secs()).ok(),
        Err(e) => i64::try_from(e.duration().as_secs()).ok().map(|s| -s),
    };
    secs.and_then(|s| time::OffsetDateTime::from_unix_timestamp(s).ok())
        .filter(|d| (1950..=9999).contains(&d.year()))
        .ok_or_else(|| Error::Certificate {
            context: "validity",
            reason: format!("{t:?} is not a date a certificate can carry (1950 to 9999)"),
        })
}

/// A moment as a readable UTC date (for messages), e.g.
/// `2026-12-08 10:16:40 UTC`.
pub fn utc_date(t: SystemTime) -> String {
    match asn1_date(t) {
        Ok(d) => format!(
            "{:04}-{:02}-{:02} {:02}:{:02}:{:02} UTC",
            d.year(),
            u8::from(d.month()),
            d.day(),
            d.hour(),
            d.minute(),
            d.second()
        ),
        Err(_) => format!("{t:?}"),
    }
}

fn system_time(unix_secs: i64) -> SystemTime {
    match u64::try_from(unix_secs) {
        Ok(s) => UNIX_EPOCH + Duration::from_secs(s),
        Err(_) => UNIX_EPOCH - Duration::from_secs(unix_secs.unsigned_abs()),
    }
}

/// What a certificate says beyond its chain: its role and expiry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CertificateFacts {
    /// The role it carries.
    pub role: Role,
    /// When it expires.
    pub not_after: SystemTime,
}

/// Reads the role and expiry of a certificate (a chain's leaf). Refuses a
/// certificate with no role, or with more than one.
pub fn certificate_facts(cert: &CertificateDer<'_>) -> Result<CertificateFacts, Error> {
    let bad = |reason: String| Error::Certificate {
        context: "certificate role",
        reason,
    };
    let (_, parsed) =
        X509Certificate::from_der(cert).map_err(|e| bad(format!("unparsable certificate: {e}")))?;
    let mut roles = Vec::new();
    if let Some(san) = parsed
        .subject_alternative_name()
        .map_err(|e| bad(format!("bad subject alternative names: {e}")))?
    {
        for name in &san.value.general_names {
            if let GeneralName::URI(uri) = name
                && let Some(role) = uri
                    .strip_prefix(ROLE_URI_SCHEME)
                    .and_then(|r| r.strip_prefix(':'))
            {
                roles.push(role.parse::<Role>()?);
            }
        }
    }
    let role = match roles.as_slice() {
        [one] => *one,
        [] => {
            return Err(bad(format!(
                "the certificate carries no role (no {ROLE_URI_SCHEME}: URI); issue a new one with a role (`regent ca issue --role ...`)"
            )));
        }
        _ => {
            return Err(bad(format!(
                "the certificate carries {} roles",
                roles.len()
            )));
        }
    };
    Ok(CertificateFacts {
        role,
        not_after: system_time(parsed.validity().not_after.timestamp()),
    })
}

impl CertificateFacts {
    /// Whether the certificate has expired by `now` (it is valid through
    /// the last second of `not_after`).
    pub fn expired_at(&self, now: SystemTime) -> bool {
        now.duration_since(self.not_after)
            .is_ok_and(|late| late >= Duration::from_secs(1))
    }
}

/// The role of a (chain-verified) peer's certificate chain.
pub fn peer_role(chain: &[CertificateDer<'_>]) -> Result<Role, Error> {
    let leaf = chain.first().ok_or_else(|| Error::Certificate {
        context: "certificate role",
        reason: "no certificate".into(),
    })?;
    Ok(certificate_facts(leaf)?.role)
}

/// The key and signature algorithm of a cluster CA and of the certificates
/// it issues.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KeyAlgorithm {
    /// ECDSA on P-256 with SHA-256, the default. Its DER signatures vary in
    /// length (70 to 72 bytes) from one signing to the next.
    #[default]
    EcdsaP256,
    /// Ed25519: signatures of fixed length (64 bytes), the same for the same
    /// input. A simulation needs it for datagram sizes that replay from a
    /// seed (see `regent_net::sim`).
    Ed25519,
}

impl KeyAlgorithm {
    fn rcgen(self) -> &'static rcgen::SignatureAlgorithm {
        match self {
            Self::EcdsaP256 => &rcgen::PKCS_ECDSA_P256_SHA256,
            Self::Ed25519 => &rcgen::PKCS_ED25519,
        }
    }

    /// The algorithm of a loaded key: Ed25519 if it is one, else the
    /// default (the keys a loaded CA issues).
    fn of(key: &KeyPair) -> Self {
        if key.algorithm() == &rcgen::PKCS_ED25519 {
            Self::Ed25519
        } else {
            Self::EcdsaP256
        }
    }
}

/// A random serial number of 20 bytes (RFC 5280's most) whose DER encoding
/// is always 20 bytes long: the first byte is in `0x40..=0x7f` (no sign
/// byte, no leading zero to strip). rcgen's default, a hash of the key,
/// loses a byte one time in 128, which changes the certificate's size.
fn serial_number() -> Result<rcgen::SerialNumber, Error> {
    let mut serial = [0u8; 20];
    crypto_provider()
        .secure_random
        .fill(&mut serial)
        .map_err(|e| Error::Certificate {
            context: "serial number",
            reason: format!("{e:?}"),
        })?;
    serial[0] = (serial[0] & 0x7f) | 0x40;
    Ok(rcgen::SerialNumber::from_slice(&serial))
}

/// The certificate authority of one cluster. The controller makes it (or
/// loads it) and issues a certificate to each proc, host agent and itself.
pub struct ClusterCa {
    cert_der: CertificateDer<'static>,
    cert_pem: String,
    issuer: Issuer<'static, KeyPair>,
    not_after: SystemTime,
    /// The algorithm of the keys it issues.
    algorithm: KeyAlgorithm,
}

impl fmt::Debug for ClusterCa {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClusterCa")
            .field("cert_der_bytes", &self.cert_der.len())
            .field("not_after", &self.not_after)
            .field("algorithm", &self.algorithm)
            .finish_non_exhaustive()
    }
}

impl ClusterCa {
    /// Makes a new CA (ECDSA P-256, [`KeyAlgorithm::default`]) whose subject is `CN=<name>`, valid for
    /// [`Validity::CA`] (365 days).
    pub fn generate(name: &str) -> Result<Self, Error> {
        Self::generate_with_validity(name, Validity::for_duration(Validity::CA)?)
    }

    /// Makes a new CA like [`Self::generate`], valid for `validity`. It
    /// issues no certificate valid past its own end.
    pub fn generate_with_validity(name: &str, validity: Validity) -> Result<Self, Error> {
        Self::generate_with(name, validity, KeyAlgorithm::default())
    }

    /// Makes a new CA like [`Self::generate_with_validity`] whose key, and
    /// the keys of the certificates it issues, are of `algorithm`.
    pub fn generate_with(
        name: &str,
        validity: Validity,
        algorithm: KeyAlgorithm,
    ) -> Result<Self, Error> {
        let key = KeyPair::generate_for(algorithm.rcgen()).map_err(cert_err("generate CA key"))?;
        let mut params =
            CertificateParams::new(Vec::<String>::new()).map_err(cert_err("CA parameters"))?;
        params.distinguished_name.push(DnType::CommonName, name);
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        params.not_before = asn1_date(validity.not_before)?;
        params.not_after = asn1_date(validity.not_after)?;
        params.serial_number = Some(serial_number()?);
        let cert = params.self_signed(&key).map_err(cert_err("self-sign CA"))?;
        Ok(Self {
            cert_der: cert.der().clone(),
            cert_pem: cert.pem(),
            issuer: Issuer::new(params, key),
            not_after: whole_seconds(validity.not_after),
            algorithm,
        })
    }

    /// Loads a CA from its certificate and private key in PEM.
    pub fn from_pem(cert_pem: &str, key_pem: &str) -> Result<Self, Error> {
        let key = KeyPair::from_pem(key_pem).map_err(cert_err("parse CA key"))?;
        let algorithm = KeyAlgorithm::of(&key);
        let cert_der = CertificateDer::from_pem_slice(cert_pem.as_bytes()).map_err(|e| {
            Error::Certificate {
                context: "parse CA certificate",
                reason: e.to_string(),
            }
        })?;
        let (_, parsed) = X509Certificate::from_der(&cert_der).map_err(|e| Error::Certificate {
            context: "parse CA certificate",
            reason: e.to_string(),
        })?;
        let not_after = system_time(parsed.validity().not_after.timestamp());
        let issuer =
            Issuer::from_ca_cert_der(&cert_der, key).map_err(cert_err("load CA issuer"))?;
        Ok(Self {
            cert_der,
            cert_pem: cert_pem.to_owned(),
            issuer,
            not_after,
            algorithm,
        })
    }

    /// Writes `ca.crt` and `ca.key` (mode 0600) into `dir`.
    pub fn save(&self, dir: &Path) -> Result<(), Error> {
        write_file(&dir.join("ca.crt"), self.cert_pem.as_bytes(), 0o644)?;
        write_file(
            &dir.join("ca.key"),
            self.issuer.key().serialize_pem().as_bytes(),
            0o600,
        )
    }

    /// Loads what [`Self::save`] wrote.
    pub fn load(dir: &Path) -> Result<Self, Error> {
        Self::from_pem(
            &read_file(&dir.join("ca.crt"))?,
            &read_file(&dir.join("ca.key"))?,
        )
    }

    /// The CA certificate in DER.
    pub fn cert_der(&self) -> &CertificateDer<'static> {
        &self.cert_der
    }

    /// The CA certificate in PEM.
    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    /// When the CA certificate expires.
    pub fn not_after(&self) -> SystemTime {
        self.not_after
    }

    /// The algorithm of the keys it issues: its own key's (ECDSA P-256 for
    /// a loaded CA whose key is not Ed25519).
    pub fn algorithm(&self) -> KeyAlgorithm {
        self.algorithm
    }

    /// Issues the certificate of `proc` with `role`, valid for `validity`
    /// (a fresh key of [`Self::algorithm`]; the proc id as DNS name and the role as a
    /// `regent-role:` URI; usable as TLS client and server). Both are
    /// chosen by the caller: a controller issues [`Role::Proc`] to its procs
    /// and [`Role::Controller`] only to itself. Refused if the certificate
    /// would outlive the CA.
    pub fn issue(
        &self,
        proc: &ProcId,
        role: Role,
        validity: Validity,
    ) -> Result<ProcCredentials, Error> {
        if whole_seconds(validity.not_after) > self.not_after {
            return Err(Error::Certificate {
                context: "issue certificate",
                reason: format!(
                    "it would be valid until {}, after the CA expires ({})",
                    utc_date(validity.not_after),
                    utc_date(self.not_after)
                ),
            });
        }
        let key =
            KeyPair::generate_for(self.algorithm.rcgen()).map_err(cert_err("generate proc key"))?;
        let mut params = CertificateParams::new(vec![proc.as_str().to_owned()])
            .map_err(cert_err("proc certificate parameters"))?;
        params.serial_number = Some(serial_number()?);
        params.subject_alt_names.push(SanType::URI(
            role.uri().try_into().map_err(cert_err("role URI"))?,
        ));
        params
            .distinguished_name
            .push(DnType::CommonName, proc.as_str());
        params.is_ca = IsCa::ExplicitNoCa;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        params.use_authority_key_identifier_extension = true;
        params.not_before = asn1_date(validity.not_before)?;
        params.not_after = asn1_date(validity.not_after)?;
        let cert = params
            .signed_by(&key, &self.issuer)
            .map_err(cert_err("sign proc certificate"))?;
        Ok(ProcCredentials {
            proc: proc.clone(),
            role,
            not_after: whole_seconds(validity.not_after),
            chain: vec![cert.der().clone()],
            key: PrivateKeyDer::try_from(key.serialize_der()).map_err(|e| Error::Certificate {
                context: "proc key",
                reason: e.to_owned(),
            })?,
            ca: self.cert_der.clone(),
        })
    }
}

#[cfg(test)]
impl ClusterCa {
    /// A certificate of `proc` whose role URIs are `uris` (any number, any
    /// text), with credentials that claim [`Role::Proc`]: for tests of
    /// certificates that carry no role, or several.
    pub(crate) fn danger_issue_with_role_uris(
        &self,
        proc: &ProcId,
        uris: &[&str],
    ) -> Result<ProcCredentials, Error> {
        let mut creds = self.issue(proc, Role::Proc, Validity::job())?;
        let key = KeyPair::generate().map_err(cert_err("generate proc key"))?;
        let mut params = CertificateParams::new(vec![proc.as_str().to_owned()])
            .map_err(cert_err("proc certificate parameters"))?;
        for uri in uris {
            params
                .subject_alt_names
                .push(SanType::URI((*uri).try_into().map_err(cert_err("URI"))?));
        }
        params.is_ca = IsCa::ExplicitNoCa;
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        params.not_before = asn1_date(SystemTime::now() - Validity::CLOCK_SKEW)?;
        params.not_after = asn1_date(SystemTime::now() + Validity::JOB)?;
        let cert = params
            .signed_by(&key, &self.issuer)
            .map_err(cert_err("sign proc certificate"))?;
        creds.chain = vec![cert.der().clone()];
        creds.key =
            PrivateKeyDer::try_from(key.serialize_der()).map_err(|e| Error::Certificate {
                context: "proc key",
                reason: e.to_owned(),
            })?;
        Ok(creds)
    }
}

/// `t` cut to the second, as a certificate carries it.
fn whole_seconds(t: SystemTime) -> SystemTime {
    match t.duration_since(UNIX_EPOCH) {
        Ok(d) => UNIX_EPOCH + Duration::from_secs(d.as_secs()),
        Err(_) => t,
    }
}

/// A proc's identity: its certificate chain and private key, the role and
/// expiry its certificate carries, and the cluster CA it trusts.
pub struct ProcCredentials {
    proc: ProcId,
    role: Role,
    not_after: SystemTime,
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
    ca: CertificateDer<'static>,
}

impl Clone for ProcCredentials {
    fn clone(&self) -> Self {
        Self {
            proc: self.proc.clone(),
            role: self.role,
            not_after: self.not_after,
            chain: self.chain.clone(),
            key: self.key.clone_key(),
            ca: self.ca.clone(),
        }
    }
}

impl fmt::Debug for ProcCredentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ProcCredentials")
            .field("proc", &self.proc)
            .field("role", &self.role)
            .field("not_after", &self.not_after)
            .field("chain_len", &self.chain.len())
            .finish_non_exhaustive()
    }
}

impl ProcCredentials {
    /// Loads credentials from PEM: the certificate chain (leaf first), the
    /// private key and the CA certificate. The leaf must name `proc`, carry
    /// a role, and not have expired.
    pub fn from_pem(
        proc: ProcId,
        chain_pem: &str,
        key_pem: &str,
        ca_pem: &str,
    ) -> Result<Self, Error> {
        let creds = Self::danger_unchecked_from_pem(proc, chain_pem, key_pem, ca_pem)?;
        verify_proc_identity(&creds.chain, &creds.proc)?;
        if creds.not_after < SystemTime::now() {
            return Err(Error::Certificate {
                context: "load credentials",
                reason: format!(
                    "the certificate of {} expired at {}; issue a new one",
                    creds.proc,
                    utc_date(creds.not_after)
                ),
            });
        }
        Ok(creds)
    }

    /// Loads credentials like [`Self::from_pem`] without checking that the
    /// certificate names `proc` or is still valid (it must still carry a
    /// role): for tests that play a proc lying about its identity. Peers
    /// refuse such a proc.
    pub fn danger_unchecked_from_pem(
        proc: ProcId,
        chain_pem: &str,
        key_pem: &str,
        ca_pem: &str,
    ) -> Result<Self, Error> {
        let pem_err = |context: &'static str| {
            move |e: rustls_pki_types::pem::Error| Error::Certificate {
                context,
                reason: e.to_string(),
            }
        };
        let chain = CertificateDer::pem_slice_iter(chain_pem.as_bytes())
            .collect::<Result<Vec<_>, _>>()
            .map_err(pem_err("parse certificate chain"))?;
        let Some(leaf) = chain.first() else {
            return Err(Error::Certificate {
                context: "parse certificate chain",
                reason: "no certificate in the PEM".into(),
            });
        };
        let facts = certificate_facts(leaf)?;
        let key =
            PrivateKeyDer::from_pem_slice(key_pem.as_bytes()).map_err(pem_err("parse key"))?;
        let ca = CertificateDer::from_pem_slice(ca_pem.as_bytes()).map_err(pem_err("parse CA"))?;
        Ok(Self {
            proc,
            role: facts.role,
            not_after: facts.not_after,
            chain,
            key,
            ca,
        })
    }

    /// The proc these credentials are for.
    pub fn proc(&self) -> &ProcId {
        &self.proc
    }

    /// The role its certificate carries.
    pub fn role(&self) -> Role {
        self.role
    }

    /// When its certificate expires.
    pub fn not_after(&self) -> SystemTime {
        self.not_after
    }

    /// The certificate chain, leaf first.
    pub fn chain(&self) -> &[CertificateDer<'static>] {
        &self.chain
    }

    /// The trusted cluster CA.
    pub fn ca(&self) -> &CertificateDer<'static> {
        &self.ca
    }

    /// The PEM forms: (certificate chain, private key, CA certificate).
    /// The key is secret: do not log it.
    pub fn to_pem(&self) -> (String, String, String) {
        let chain = self.chain.iter().map(|c| pem("CERTIFICATE", c)).collect();
        let key = pem("PRIVATE KEY", self.key.secret_der());
        (chain, key, pem("CERTIFICATE", &self.ca))
    }

    /// Writes `<proc>.crt`, `<proc>.key` (mode 0600) and `ca.crt` into `dir`.
    pub fn save(&self, dir: &Path) -> Result<(), Error> {
        let (chain, key, ca) = self.to_pem();
        write_file(
            &dir.join(format!("{}.crt", self.proc)),
            chain.as_bytes(),
            0o644,
        )?;
        write_file(
            &dir.join(format!("{}.key", self.proc)),
            key.as_bytes(),
            0o600,
        )?;
        write_file(&dir.join("ca.crt"), ca.as_bytes(), 0o644)
    }

    /// Loads what [`Self::save`] wrote for `proc`.
    pub fn load(dir: &Path, proc: ProcId) -> Result<Self, Error> {
        let chain = read_file(&dir.join(format!("{proc}.crt")))?;
        let key = read_file(&dir.join(format!("{proc}.key")))?;
        let ca = read_file(&dir.join("ca.crt"))?;
        Self::from_pem(proc, &chain, &key, &ca)
    }

    fn roots(&self) -> Result<Arc<RootCertStore>, Error> {
        let mut roots = RootCertStore::empty();
        roots
            .add(self.ca.clone())
            .map_err(tls("trust the cluster CA"))?;
        Ok(Arc::new(roots))
    }

    /// A TLS 1.3 server config that requires a client certificate from the
    /// cluster CA, valid now (checked at every handshake: no session
    /// resumption). The caller checks the client's claimed proc with
    /// [`verify_proc_identity`] and its role with [`peer_role`].
    pub fn server_config(&self) -> Result<rustls::ServerConfig, Error> {
        let provider = crypto_provider();
        let verifier = WebPkiClientVerifier::builder_with_provider(self.roots()?, provider.clone())
            .build()
            .map_err(|e| Error::Tls {
                context: "client verifier",
                reason: e.to_string(),
            })?;
        let mut config = rustls::ServerConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(tls("server protocol versions"))?
            .with_client_cert_verifier(verifier)
            .with_single_cert(self.chain.clone(), self.key.clone_key())
            .map_err(tls("server certificate"))?;
        config.alpn_protocols = vec![ALPN.to_vec()];
        // No session resumption: a resumed session skips the verifier, so a
        // certificate that expired since the first handshake would pass.
        config.session_storage = Arc::new(rustls::server::NoServerSessionStorage {});
        config.send_tls13_tickets = 0;
        Ok(config)
    }

    /// A TLS 1.3 client config that trusts only the cluster CA (a server
    /// certificate valid now, checked at every handshake: no session
    /// resumption) and presents this proc's certificate. Connect with the peer's proc id as server
    /// name ([`server_name`]).
    pub fn client_config(&self) -> Result<rustls::ClientConfig, Error> {
        let mut config = rustls::ClientConfig::builder_with_provider(crypto_provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(tls("client protocol versions"))?
            .with_root_certificates(self.roots()?)
            .with_client_auth_cert(self.chain.clone(), self.key.clone_key())
            .map_err(tls("client certificate"))?;
        config.alpn_protocols = vec![ALPN.to_vec()];
        // Every handshake verifies the peer's certificate (see server_config).
        config.resumption = rustls::client::Resumption::disabled();
        Ok(config)
    }

    /// The quinn server config (mutual TLS, see [`Self::server_config`]).
    pub fn quic_server_config(&self) -> Result<quinn::ServerConfig, Error> {
        let crypto = quinn::crypto::rustls::QuicServerConfig::try_from(self.server_config()?)
            .map_err(|e| Error::Tls {
                context: "QUIC server config",
                reason: e.to_string(),
            })?;
        Ok(quinn::ServerConfig::with_crypto(Arc::new(crypto)))
    }

    /// The quinn client config (see [`Self::client_config`]).
    pub fn quic_client_config(&self) -> Result<quinn::ClientConfig, Error> {
        let crypto = quinn::crypto::rustls::QuicClientConfig::try_from(self.client_config()?)
            .map_err(|e| Error::Tls {
                context: "QUIC client config",
                reason: e.to_string(),
            })?;
        Ok(quinn::ClientConfig::new(Arc::new(crypto)))
    }
}

/// The TLS server name of a proc.
pub fn server_name(proc: &ProcId) -> Result<ServerName<'static>, Error> {
    Ok(ServerName::DnsName(
        DnsName::try_from(proc.as_str().to_owned()).map_err(|e| Error::Certificate {
            context: "proc id as DNS name",
            reason: e.to_string(),
        })?,
    ))
}

/// Checks that a (chain-verified) peer certificate chain names `proc`.
pub fn verify_proc_identity(chain: &[CertificateDer<'_>], proc: &ProcId) -> Result<(), Error> {
    let leaf = chain.first().ok_or_else(|| Error::Identity {
        claimed: proc.clone(),
        reason: "no certificate".into(),
    })?;
    let cert = webpki::EndEntityCert::try_from(leaf).map_err(|e| Error::Identity {
        claimed: proc.clone(),
        reason: format!("unparsable certificate: {e}"),
    })?;
    cert.verify_is_valid_for_subject_name(&server_name(proc)?)
        .map_err(|e| Error::Identity {
            claimed: proc.clone(),
            reason: format!("certificate does not name it: {e}"),
        })
}

fn pem(label: &str, der: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut b64 = String::with_capacity(der.len().div_ceil(3) * 4);
    for chunk in der.chunks(3) {
        let n = chunk.len();
        let v = (u32::from(chunk[0]) << 16)
            | (u32::from(*chunk.get(1).unwrap_or(&0)) << 8)
            | u32::from(*chunk.get(2).unwrap_or(&0));
        for i in 0..4 {
            if i <= n {
                b64.push(ALPHABET[((v >> (18 - 6 * i)) & 63) as usize] as char);
            } else {
                b64.push('=');
            }
        }
    }
    let mut out = format!("-----BEGIN {label}-----\n");
    for line in b64.as_bytes().chunks(64) {
        out.push_str(std::str::from_utf8(line).unwrap_or_default());
        out.push('\n');
    }
    out.push_str(&format!("-----END {label}-----\n"));
    out
}

fn write_file(path: &Path, bytes: &[u8], mode: u32) -> Result<(), Error> {
    let io = |e: std::io::Error| Error::Io {
        context: "write credentials",
        path: Some(PathBuf::from(path)),
        source: e,
    };
    let mut file = fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(mode)
        .open(path)
        .map_err(io)?;
    file.write_all(bytes).map_err(io)
}

fn read_file(path: &Path) -> Result<String, Error> {
    fs::read_to_string(path).map_err(|e| Error::Io {
        context: "read credentials",
        path: Some(PathBuf::from(path)),
        source: e,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn issued_certificates_name_their_proc_and_load_back() {
        let ca = ClusterCa::generate("test CA").unwrap();
        let alice = ProcId::new("alice").unwrap();
        let creds = ca.issue(&alice, Role::Proc, Validity::job()).unwrap();
        verify_proc_identity(creds.chain(), &alice).unwrap();
        let bob = ProcId::new("bob").unwrap();
        assert!(matches!(
            verify_proc_identity(creds.chain(), &bob),
            Err(Error::Identity { .. })
        ));
        let (chain, key, ca_pem) = creds.to_pem();
        let loaded = ProcCredentials::from_pem(alice.clone(), &chain, &key, &ca_pem).unwrap();
        assert_eq!(loaded.chain(), creds.chain());
        assert!(ProcCredentials::from_pem(bob, &chain, &key, &ca_pem).is_err());
        assert!(!format!("{creds:?}").contains("PRIVATE"));
        // A CA loaded back from PEM issues certificates that the original
        // CA's trust accepts.
        let dir = std::env::temp_dir().join(format!("regent-net-tls-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        ca.save(&dir).unwrap();
        let again = ClusterCa::load(&dir).unwrap();
        let carol = again
            .issue(&ProcId::new("carol").unwrap(), Role::Proc, Validity::job())
            .unwrap();
        assert_eq!(again.not_after(), ca.not_after());
        assert_eq!(carol.ca(), ca.cert_der());
        creds.save(&dir).unwrap();
        let back = ProcCredentials::load(&dir, alice).unwrap();
        assert_eq!(back.chain(), creds.chain());
        fs::remove_dir_all(&dir).unwrap();
        // Configs build.
        creds.quic_server_config().unwrap();
        creds.quic_client_config().unwrap();
    }

    /// Both ends of a handshake between two procs' configs agree on
    /// AES-128-GCM ([`crypto_provider`]'s first suite; ring's own order
    /// would pick AES-256-GCM).
    #[test]
    fn procs_negotiate_aes_128_gcm() {
        use rustls::CipherSuite::TLS13_AES_128_GCM_SHA256;
        let ca = ClusterCa::generate("test CA").unwrap();
        let (alice, bob) = (ProcId::new("alice").unwrap(), ProcId::new("bob").unwrap());
        let client_creds = ca.issue(&alice, Role::Proc, Validity::job()).unwrap();
        let server_creds = ca.issue(&bob, Role::Proc, Validity::job()).unwrap();
        let mut client = rustls::ClientConnection::new(
            Arc::new(client_creds.client_config().unwrap()),
            server_name(&bob).unwrap(),
        )
        .unwrap();
        let mut server =
            rustls::ServerConnection::new(Arc::new(server_creds.server_config().unwrap())).unwrap();
        // Carry each side's records to the other until both are done.
        for _ in 0..10 {
            let mut bytes = Vec::new();
            client.write_tls(&mut bytes).unwrap();
            server.read_tls(&mut &bytes[..]).unwrap();
            server.process_new_packets().unwrap();
            bytes.clear();
            server.write_tls(&mut bytes).unwrap();
            client.read_tls(&mut &bytes[..]).unwrap();
            client.process_new_packets().unwrap();
            if !client.is_handshaking() && !server.is_handshaking() {
                break;
            }
        }
        assert!(!client.is_handshaking() && !server.is_handshaking());
        let suite = |s: Option<rustls::SupportedCipherSuite>| s.unwrap().suite();
        assert_eq!(
            suite(client.negotiated_cipher_suite()),
            TLS13_AES_128_GCM_SHA256
        );
        assert_eq!(
            suite(server.negotiated_cipher_suite()),
            TLS13_AES_128_GCM_SHA256
        );
    }

    #[test]
    fn certificates_carry_the_role_and_validity_they_were_issued_with() {
        let ca = ClusterCa::generate("test CA").unwrap();
        let p = ProcId::new("p").unwrap();
        for role in Role::ALL {
            assert_eq!(role.as_str().parse::<Role>().unwrap(), role);
            let creds = ca.issue(&p, role, Validity::job()).unwrap();
            assert_eq!(creds.role(), role);
            let facts = certificate_facts(&creds.chain()[0]).unwrap();
            assert_eq!(facts.role, role);
            assert_eq!(peer_role(creds.chain()).unwrap(), role);
            assert_eq!(facts.not_after, creds.not_after());
            // The role is in the signed certificate, not only in our struct:
            // it survives PEM.
            let (chain, key, ca_pem) = creds.to_pem();
            let loaded = ProcCredentials::from_pem(p.clone(), &chain, &key, &ca_pem).unwrap();
            assert_eq!(loaded.role(), role);
            assert_eq!(loaded.not_after(), creds.not_after());
            // Still a valid name for the proc.
            verify_proc_identity(creds.chain(), &p).unwrap();
        }
        assert!("admin".parse::<Role>().is_err());
        assert_eq!(
            utc_date(UNIX_EPOCH + Duration::from_secs(1_000_000_000)),
            "2001-09-09 01:46:40 UTC"
        );

        // A job's validity: 7 days from now, to the second.
        let creds = ca.issue(&p, Role::Proc, Validity::job()).unwrap();
        let left = creds.not_after().duration_since(SystemTime::now()).unwrap();
        assert!(left <= Validity::JOB && left > Validity::JOB - Duration::from_secs(60));
        // The CA's own validity (365 days) bounds what it issues.
        let ca_left = ca.not_after().duration_since(SystemTime::now()).unwrap();
        assert!(ca_left <= Validity::CA && ca_left > Validity::CA - Duration::from_secs(60));
        let too_long = Validity::for_duration(Validity::CA * 2).unwrap();
        let e = ca.issue(&p, Role::Proc, too_long).unwrap_err();
        assert!(e.to_string().contains("after the CA expires"), "{e}");

        // Validities that are not: empty, reversed, past year 9999.
        assert!(Validity::for_duration(Duration::ZERO).is_err());
        let now = SystemTime::now();
        assert!(Validity::between(now, now).is_err());
        assert!(Validity::between(now + Duration::from_secs(1), now).is_err());
        assert!(Validity::for_duration(Duration::from_secs(u64::MAX)).is_err());
        assert!(Validity::for_duration(Duration::from_secs(9000 * 365 * 24 * 3600)).is_err());

        // Expired credentials do not load (peers would refuse them anyway).
        let past = Validity::between(
            now - Duration::from_secs(7200),
            now - Duration::from_secs(3600),
        )
        .unwrap();
        let expired = ca.issue(&p, Role::Proc, past).unwrap();
        let (chain, key, ca_pem) = expired.to_pem();
        let e = ProcCredentials::from_pem(p.clone(), &chain, &key, &ca_pem).unwrap_err();
        assert!(e.to_string().contains("expired"), "{e}");
        assert!(ProcCredentials::danger_unchecked_from_pem(p, &chain, &key, &ca_pem).is_ok());
    }

    #[test]
    fn certificates_without_exactly_one_role_are_refused() {
        let ca = ClusterCa::generate("test CA").unwrap();
        let p = ProcId::new("p").unwrap();
        let none = ca.danger_issue_with_role_uris(&p, &[]).unwrap();
        let e = certificate_facts(&none.chain()[0]).unwrap_err();
        assert!(e.to_string().contains("no role"), "{e}");
        let (chain, key, ca_pem) = none.to_pem();
        assert!(ProcCredentials::from_pem(p.clone(), &chain, &key, &ca_pem).is_err());
        let two = ca
            .danger_issue_with_role_uris(&p, &["regent-role:proc", "regent-role:controller"])
            .unwrap();
        let e = certificate_facts(&two.chain()[0]).unwrap_err();
        assert!(e.to_string().contains("2 roles"), "{e}");
        let unknown = ca
            .danger_issue_with_role_uris(&p, &["regent-role:root"])
            .unwrap();
        assert!(certificate_facts(&unknown.chain()[0]).is_err());
        // Other URIs are not roles.
        let other = ca
            .danger_issue_with_role_uris(&p, &["https://example.com/", "regent-role:proc"])
            .unwrap();
        assert_eq!(
            certificate_facts(&other.chain()[0]).unwrap().role,
            Role::Proc
        );
    }

    #[test]
    fn ed25519_certificates_have_one_size_and_load_back_as_ed25519() {
        // A simulation needs datagrams of the same size run to run: every
        // certificate of a CA the same length (the serial never loses a
        // byte), and the CA's algorithm kept when it is loaded again.
        let ca = ClusterCa::generate_with(
            "sizes",
            Validity::for_duration(Validity::CA).unwrap(),
            KeyAlgorithm::Ed25519,
        )
        .unwrap();
        let p = ProcId::new("p").unwrap();
        let sizes: std::collections::BTreeSet<usize> = (0..400)
            .map(|_| ca.issue(&p, Role::Proc, Validity::job()).unwrap().chain()[0].len())
            .collect();
        assert_eq!(sizes.len(), 1, "certificate sizes {sizes:?}");
        let cas: std::collections::BTreeSet<usize> = (0..100)
            .map(|_| {
                ClusterCa::generate_with(
                    "sizes",
                    Validity::for_duration(Validity::CA).unwrap(),
                    KeyAlgorithm::Ed25519,
                )
                .unwrap()
                .cert_der()
                .len()
            })
            .collect();
        assert_eq!(cas.len(), 1, "CA certificate sizes {cas:?}");
        let loaded = ClusterCa::from_pem(ca.cert_pem(), &ca.issuer.key().serialize_pem()).unwrap();
        assert_eq!(loaded.algorithm(), KeyAlgorithm::Ed25519);
        assert_eq!(
            ClusterCa::generate("default").unwrap().algorithm(),
            KeyAlgorithm::EcdsaP256
        );
    }

    #[test]
    fn pem_matches_rcgen() {
        let key = KeyPair::generate().unwrap();
        assert_eq!(
            pem("PRIVATE KEY", &key.serialize_der()).replace('\r', ""),
            key.serialize_pem().replace('\r', "")
        );
    }
}
