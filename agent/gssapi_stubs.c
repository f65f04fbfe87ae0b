/* libssh.a (Debian's libssh-dev) is built with GSSAPI, and Debian ships no static libgssapi_krb5, so the
 * static agent provides these symbols itself. None is ever called: the agent's SSH server offers the
 * publickey method only (ssh_set_auth_methods in ssh_server.cc), so libssh never starts a GSSAPI exchange.
 * Each fails with GSS_S_FAILURE all the same, should that ever change. */
#define SG_GSS_STUB(name)                            \
  unsigned int name(unsigned int* minor_status);     \
  unsigned int name(unsigned int* minor_status) {    \
    if (minor_status) *minor_status = 0;             \
    return 13u << 16; /* GSS_S_FAILURE */            \
  }
SG_GSS_STUB(gss_accept_sec_context)
SG_GSS_STUB(gss_acquire_cred)
SG_GSS_STUB(gss_add_oid_set_member)
SG_GSS_STUB(gss_create_empty_oid_set)
SG_GSS_STUB(gss_display_name)
SG_GSS_STUB(gss_display_status)
SG_GSS_STUB(gss_get_mic)
SG_GSS_STUB(gss_import_name)
SG_GSS_STUB(gss_indicate_mechs)
SG_GSS_STUB(gss_init_sec_context)
SG_GSS_STUB(gss_inquire_cred)
SG_GSS_STUB(gss_inquire_cred_by_mech)
SG_GSS_STUB(gss_release_buffer)
SG_GSS_STUB(gss_release_cred)
SG_GSS_STUB(gss_release_name)
SG_GSS_STUB(gss_release_oid_set)
SG_GSS_STUB(gss_test_oid_set_member)
SG_GSS_STUB(gss_verify_mic)
void* GSS_C_NT_HOSTBASED_SERVICE = 0;
void* GSS_C_NT_USER_NAME = 0;
