// kstatus prints the verdict of Flux's health checks (kstatus, sigs.k8s.io/cli-utils
// pkg/kstatus/status.Compute) for one Kubernetes object read as JSON on stdin:
//
//	kstatus < obj.json
//	{"status": "InProgress", "message": "..."}
//
// Built by hack/build-gitops-tools.sh against the pinned cli-utils release.
package main

import (
	"encoding/json"
	"fmt"
	"io"
	"os"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"sigs.k8s.io/cli-utils/pkg/kstatus/status"
)

type verdict struct {
	Status  string `json:"status"`
	Message string `json:"message"`
}

func main() {
	if len(os.Args) > 1 {
		fmt.Fprintln(os.Stderr, "usage: kstatus < obj.json")
		os.Exit(2)
	}
	data, err := io.ReadAll(os.Stdin)
	if err != nil {
		fail("reading stdin: %v", err)
	}
	// UnmarshalJSON, not json.Unmarshal: it keeps integers as int64, as the API
	// machinery does; float64 numbers make kstatus fail on metadata.generation.
	obj := &unstructured.Unstructured{}
	if err := obj.UnmarshalJSON(data); err != nil {
		fail("decoding the object: %v", err)
	}
	res, err := status.Compute(obj)
	if err != nil {
		fail("kstatus: %v", err)
	}
	out, err := json.Marshal(verdict{Status: res.Status.String(), Message: res.Message})
	if err != nil {
		fail("encoding the verdict: %v", err)
	}
	fmt.Println(string(out))
}

func fail(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "kstatus: "+format+"\n", args...)
	os.Exit(1)
}
