// argocd-health prints the health Argo CD gives one object read as JSON on stdin, with a
// resource health check in Lua installed as argocd-cm's
// `resource.customizations.health.<group>_<Kind>` key installs it:
//
//	argocd-health --script health.lua < obj.json
//	{"status": "Healthy", "message": "..."}
//
// It runs Argo CD's own code, not a copy of it: the override lookup and the Lua VM of
// github.com/argoproj/argo-cd/v3/util/lua (ResourceHealthOverrides, VM.ExecuteHealthLua:
// libraries, `obj` as a table, the 1 s time limit, the check of the returned status),
// called through gitops-engine's health.GetResourceHealth as the application controller
// calls it. The standard libraries stay closed, as they do unless argocd-cm sets
// `resource.customizations.useOpenLibs.<group>_<Kind>: "true"`.
//
// Without --script only Argo CD's built-in checks apply, and an OmniPipeline gets no
// health at all: status "" (an Application then counts it as Healthy).
//
// Exit status: 0 with a verdict; 1 when the object cannot be read or the script fails (a
// Lua error, the time limit, a result that is not a table); 3 when the script returns nil,
// an empty table, or a status that is not one of Argo CD's (Argo CD shows the last as
// Unknown, and gives the first two no health).
package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"

	"github.com/argoproj/gitops-engine/pkg/health"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"

	appv1 "github.com/argoproj/argo-cd/v3/pkg/apis/application/v1alpha1"
	argolua "github.com/argoproj/argo-cd/v3/util/lua"
)

// invalidHealthStatus is the message util/lua puts on an Unknown verdict when a script
// returns a status that is not one of Argo CD's (unexported there as invalidHealthStatus).
const invalidHealthStatus = "Lua returned an invalid health status"

type verdict struct {
	Status  string `json:"status"`
	Message string `json:"message"`
}

func main() {
	script := flag.String("script", "", "the health check in Lua (the value of argocd-cm's key)")
	key := flag.String("key", "omnipipe.io_OmniPipeline",
		"the <group>_<Kind> the check is installed for, as in resource.customizations.health.<group>_<Kind>")
	flag.Usage = func() {
		fmt.Fprintln(os.Stderr, "usage: argocd-health [--script FILE] [--key GROUP_KIND] < obj.json")
		flag.PrintDefaults()
	}
	flag.Parse()
	if flag.NArg() > 0 {
		flag.Usage()
		os.Exit(2)
	}

	data, err := io.ReadAll(os.Stdin)
	if err != nil {
		fail(1, "reading stdin: %v", err)
	}
	obj := &unstructured.Unstructured{}
	if err := obj.UnmarshalJSON(data); err != nil {
		fail(1, "decoding the object: %v", err)
	}

	overrides := argolua.ResourceHealthOverrides{}
	if *script != "" {
		lua, err := os.ReadFile(*script)
		if err != nil {
			fail(1, "reading the script: %v", err)
		}
		overrideKey, err := overrideKey(*key)
		if err != nil {
			fail(2, "%v", err)
		}
		overrides[overrideKey] = appv1.ResourceOverride{HealthLua: string(lua)}
	}

	hs, err := health.GetResourceHealth(obj, overrides)
	if err != nil {
		if hs != nil {
			emit(hs)
		}
		fail(1, "the health check failed: %v", err)
	}
	if hs == nil {
		emit(&health.HealthStatus{Message: fmt.Sprintf(
			"no health check for %s: Argo CD gives it no health", argolua.GetConfigMapKey(obj.GroupVersionKind()))})
		return
	}
	emit(hs)
	switch {
	case hs.Status == health.HealthStatusUnknown && hs.Message == invalidHealthStatus:
		fail(3, "the script returned a status that is not one of Healthy, Progressing, Degraded, "+
			"Suspended, Missing, Unknown (Argo CD shows it as Unknown)")
	case hs.Status == "":
		fail(3, "the script returned no status (nil, or an empty table)")
	}
}

// overrideKey turns argocd-cm's <group>_<Kind> into the <group>/<Kind> key of the
// resource overrides, as util/settings' convertToOverrideKey does (unexported there).
func overrideKey(groupKind string) (string, error) {
	parts := strings.Split(groupKind, "_")
	switch {
	case len(parts) == 2:
		return parts[0] + "/" + parts[1], nil
	case len(parts) == 1 && groupKind != "":
		return groupKind, nil
	}
	return "", fmt.Errorf("--key %q: want <group>_<Kind> or <Kind>", groupKind)
}

func emit(hs *health.HealthStatus) {
	out, err := json.Marshal(verdict{Status: string(hs.Status), Message: hs.Message})
	if err != nil {
		fail(1, "encoding the verdict: %v", err)
	}
	fmt.Println(string(out))
}

func fail(code int, format string, args ...any) {
	fmt.Fprintf(os.Stderr, "argocd-health: "+format+"\n", args...)
	os.Exit(code)
}
