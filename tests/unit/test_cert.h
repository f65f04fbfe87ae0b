// A self-signed certificate for the unit tests that run a real TLS server or the proxy itself.
#pragma once

#include <openssl/pem.h>
#include <openssl/x509v3.h>

#include <cstdio>
#include <string>

namespace sg::test_support {

// A self-signed certificate for *.sandbox.localhost, written where the CA file is expected; or one issued by
// another TestCert (a chain: root, intermediate, leaf).
struct TestCert {
  EVP_PKEY* key = nullptr;
  X509* cert = nullptr;
  TestCert() : TestCert("sandgate test", nullptr, true) {}
  TestCert(const char* common_name, const TestCert* issuer, bool is_ca) {
    key = EVP_EC_gen("P-256");
    cert = X509_new();
    X509_set_version(cert, 2);
    ASN1_INTEGER_set(X509_get_serialNumber(cert), 1);
    X509_gmtime_adj(X509_getm_notBefore(cert), -60);
    X509_gmtime_adj(X509_getm_notAfter(cert), 3600);
    X509_set_pubkey(cert, key);
    X509_NAME* name = X509_get_subject_name(cert);
    X509_NAME_add_entry_by_txt(name, "CN", MBSTRING_ASC, reinterpret_cast<const unsigned char*>(common_name), -1,
                               -1, 0);
    X509_set_issuer_name(cert, issuer ? X509_get_subject_name(issuer->cert) : name);
    X509V3_CTX ctx;
    X509V3_set_ctx_nodb(&ctx);
    X509V3_set_ctx(&ctx, issuer ? issuer->cert : cert, cert, nullptr, nullptr, 0);
    for (auto [nid, value] : {std::pair{NID_subject_alt_name, "DNS:*.sandbox.localhost"},
                              std::pair{NID_basic_constraints, is_ca ? "critical,CA:TRUE" : "critical,CA:FALSE"}}) {
      X509_EXTENSION* ext = X509V3_EXT_conf_nid(nullptr, &ctx, nid, value);
      X509_add_ext(cert, ext, -1);
      X509_EXTENSION_free(ext);
    }
    X509_sign(cert, issuer ? issuer->key : key, EVP_sha256());
  }
  ~TestCert() {
    X509_free(cert);
    EVP_PKEY_free(key);
  }
  void write_pem(const std::string& path) const {
    FILE* f = std::fopen(path.c_str(), "w");
    PEM_write_X509(f, cert);
    std::fclose(f);
  }
  // Another certificate after this one in the file at `path` (a chain file: the leaf first).
  void append_pem(const std::string& path) const {
    FILE* f = std::fopen(path.c_str(), "a");
    PEM_write_X509(f, cert);
    std::fclose(f);
  }
  void write_key_pem(const std::string& path) const {
    FILE* f = std::fopen(path.c_str(), "w");
    PEM_write_PrivateKey(f, key, nullptr, nullptr, 0, nullptr, nullptr);
    std::fclose(f);
  }
};

}  // namespace sg::test_support
