"""sandgate.config: settings come from where the CLI takes them, tokens are saved as the CLI saves them."""
import os
import stat
import tempfile
import unittest

from sandgate import config as C
from sandgate.errors import InvalidArgumentError, NotFoundError


class TempHome(unittest.TestCase):
    def setUp(self):
        self._tmp = tempfile.TemporaryDirectory(prefix="sandgate-sdk-unit.")
        self.dir = self._tmp.name
        self.env = {"HOME": self.dir + "/home"}
        os.mkdir(self.env["HOME"])

    def tearDown(self):
        self._tmp.cleanup()


class ResolveTest(TempHome):
    def test_defaults(self):
        s = C.Settings.resolve(env={})
        self.assertEqual(str(s.api), "unix:/run/sandgate/node.sock")
        self.assertEqual((s.ingress, s.domain, s.cacert, s.operator_token),
                         (("127.0.0.1", 8443), "sandbox.localhost", "", ""))

    def test_environment_then_arguments(self):
        env = {"SANDGATE_API": "unix:/x/node.sock", "SANDGATE_TOKEN": "op-tok", "SANDGATE_CACERT": "/ca.pem",
               "SANDGATE_INGRESS": "10.0.0.1:9443", "SANDGATE_DOMAIN": "sb.example"}
        s = C.Settings.resolve(env=env)
        self.assertEqual((s.api.path, s.operator_token, s.cacert, s.ingress, s.domain),
                         ("/x/node.sock", "op-tok", "/ca.pem", ("10.0.0.1", 9443), "sb.example"))
        s = C.Settings.resolve(api="unix:/y.sock", token="t2", cacert="/c2", ingress="[::1]:1", domain="d2", env=env)
        self.assertEqual((s.api.path, s.operator_token, s.cacert, s.ingress, s.domain),
                         ("/y.sock", "t2", "/c2", ("::1", 1), "d2"))

    def test_ingress_file_next_to_the_socket(self):
        with open(self.dir + "/ingress", "w") as f:
            f.write("# written by the quickstart\ningress=127.0.0.1:7443\ncacert=/tls/ca.pem\ndomain=d.test\nnew=1\n")
        s = C.Settings.resolve(env={"SANDGATE_API": f"unix:{self.dir}/node.sock"})
        self.assertEqual((s.ingress, s.cacert, s.domain), (("127.0.0.1", 7443), "/tls/ca.pem", "d.test"))
        s = C.Settings.resolve(env={"SANDGATE_API": f"unix:{self.dir}/node.sock", "SANDGATE_INGRESS": "h:1"})
        self.assertEqual(s.ingress, ("h", 1))
        with open(self.dir + "/ingress", "w") as f:
            f.write("cacert=relative.pem\n")
        with self.assertRaisesRegex(InvalidArgumentError, "ingress:1: cacert must be an absolute path"):
            C.Settings.resolve(env={"SANDGATE_API": f"unix:{self.dir}/node.sock"})

    def test_https_api_names_domain_and_ingress(self):
        s = C.Settings.resolve(env={"SANDGATE_API": "https://api.sb.example:8443", "SANDGATE_TOKEN": "t"})
        self.assertEqual((s.api.host, s.api.port, s.ingress, s.domain),
                         ("api.sb.example", 8443, ("api.sb.example", 8443), "sb.example"))
        self.assertEqual(C.parse_api_address("https://api.x/").port, 443)

    def test_bad_addresses(self):
        for bad in ("node.sock", "unix:rel.sock", "http://10.1.1.1:80", "https://a/b", "ftp://x", "http://h"):
            with self.assertRaises(InvalidArgumentError, msg=bad):
                C.parse_api_address(bad)
        for bad in ("h", "h:0", "h:70000", ":1", "[::1]"):
            with self.assertRaises(InvalidArgumentError, msg=bad):
                C.parse_host_port(bad, "ingress")
        with self.assertRaises(InvalidArgumentError):
            C.Settings.resolve(env={"SANDGATE_TOKEN": "has space"})

    def test_localhost_dials_loopback(self):
        self.assertEqual(C.dial_host("api.sandbox.localhost"), "127.0.0.1")
        self.assertEqual(C.dial_host("example.com"), "example.com")


class TokenFileTest(TempHome):
    def test_saved_like_the_cli(self):
        path = C.save_token("demo", "sgt_abc", self.env)
        self.assertEqual(path, self.env["HOME"] + "/.config/sandgate/tokens/demo")
        with open(path) as f:
            self.assertEqual(f.read(), "sgt_abc\n")
        self.assertEqual(stat.S_IMODE(os.stat(path).st_mode), 0o600)
        for d in ("/.config/sandgate", "/.config/sandgate/tokens"):
            self.assertEqual(stat.S_IMODE(os.stat(self.env["HOME"] + d).st_mode), 0o700)
        self.assertEqual(C.load_token("demo", self.env), "sgt_abc")
        C.save_token("demo", "sgt_new", self.env)  # replaced, as a token rotation does
        self.assertEqual(C.load_token("demo", self.env), "sgt_new")
        C.remove_token("demo", self.env)
        with self.assertRaisesRegex(NotFoundError, "no token saved for demo"):
            C.load_token("demo", self.env)
        C.remove_token("demo", self.env)  # already gone: fine

    def test_xdg_config_home_wins(self):
        env = dict(self.env, XDG_CONFIG_HOME=self.dir + "/xdg")
        self.assertTrue(C.save_token("a", "t", env).startswith(self.dir + "/xdg/sandgate/tokens/"))

    def test_refused_inputs(self):
        for ref in ("../x", "A", "-a", "a" * 64, "", "a/b"):
            with self.assertRaises(InvalidArgumentError, msg=ref):
                C.token_file(ref, self.env)
        C.save_token("real", "t", self.env)
        os.symlink(self.env["HOME"] + "/.config/sandgate/tokens/real", self.env["HOME"] + "/.config/sandgate/tokens/link")
        with self.assertRaises(Exception):
            C.load_token("link", self.env)  # never read through a symlink
        with open(self.env["HOME"] + "/.config/sandgate/tokens/big", "w") as f:
            f.write("x" * (C.MAX_TOKEN_FILE_BYTES + 1))
        with self.assertRaisesRegex(InvalidArgumentError, "larger than"):
            C.load_token("big", self.env)
        with open(self.env["HOME"] + "/.config/sandgate/tokens/two", "w") as f:
            f.write("a b\n")
        with self.assertRaisesRegex(InvalidArgumentError, "does not hold a token"):
            C.load_token("two", self.env)

    def test_query_path(self):
        self.assertEqual(C.quote_query_path("/a b/c+d"), "/a%20b/c%2Bd")
        with self.assertRaises(InvalidArgumentError):
            C.quote_query_path("rel")


if __name__ == "__main__":
    unittest.main()
